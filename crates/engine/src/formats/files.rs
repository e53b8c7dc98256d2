//! Opening the files a load reads: regular files only, never blocking.
//!
//! Every file a model load reads (GGUF, safetensors shards, `config.json`, the index,
//! `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`,
//! `chat_template.jinja`) goes through [`open_regular`]. A FIFO given as the model path would
//! otherwise block `open(2)` forever (a FIFO's open waits for a writer), and a character
//! device (`/dev/zero`) or a directory would be read or mapped as if it were a model. So:
//! 1. `stat` the path (following symlinks) and refuse anything that is not a regular file,
//!    naming what it is;
//! 2. open it with `O_NONBLOCK` (a FIFO swapped in after the `stat` then opens at once
//!    instead of blocking) and `O_NOCTTY`;
//! 3. `fstat` the opened handle and check again, so the check applies to the very file that
//!    will be read.
//!
//! `O_NONBLOCK` has no effect on reads of a regular file.

use std::fs::{File, FileType, OpenOptions};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::{Error, Result};

/// What a non-regular file is, for error messages.
fn kind_of(ft: &FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if ft.is_char_device() {
            return "a character device";
        }
        if ft.is_block_device() {
            return "a block device";
        }
        if ft.is_socket() {
            return "a socket";
        }
    }
    if ft.is_dir() {
        "a directory"
    } else if ft.is_symlink() {
        "a symbolic link"
    } else {
        "not a regular file"
    }
}

fn not_regular(path: &Path, ft: &FileType) -> Error {
    Error::io(
        path,
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("is {}, not a regular file; tboost reads models from regular files only", kind_of(ft)),
        ),
    )
}

/// Opens `path` for reading if it is a regular file; returns the handle and its length.
/// Anything else (FIFO, directory, device, socket) is an error naming the path and what it
/// is; a missing file is an `Io` error of kind `NotFound`.
pub fn open_regular(path: &Path) -> Result<(File, u64)> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(not_regular(path, &meta.file_type()));
    }
    let mut opts = OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC);
    }
    let file = opts.open(path).map_err(|e| Error::io(path, e))?;
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(not_regular(path, &meta.file_type()));
    }
    Ok((file, meta.len()))
}

/// Reads a whole regular file of at most `max_bytes` bytes. `what` names the file's role in
/// the size error (`config.json`...). The buffer is reserved fallibly, so even a size just
/// under the cap is an error, not an abort, when memory is short.
pub fn read_regular(path: &Path, max_bytes: u64, what: &str) -> Result<Vec<u8>> {
    let (file, len) = open_regular(path)?;
    if len > max_bytes {
        return Err(Error::format(
            path,
            format!("{what} is {len} bytes, above tboost's limit of {max_bytes} bytes for it; the file is corrupt or not a {what}"),
        ));
    }
    let mut buf = Vec::new();
    // `len <= max_bytes`, which fits in usize on every supported target.
    buf.try_reserve_exact(len as usize).map_err(|e| {
        Error::io(
            path,
            io::Error::new(io::ErrorKind::OutOfMemory, format!("cannot allocate {len} bytes to read it: {e}")),
        )
    })?;
    // Read at most one byte past the stated length: a file that grew since the stat is cut
    // off at the cap instead of read without bound.
    file.take(max_bytes.saturating_add(1)).read_to_end(&mut buf).map_err(|e| Error::io(path, e))?;
    if buf.len() as u64 > max_bytes {
        return Err(Error::format(
            path,
            format!("{what} grew beyond tboost's limit of {max_bytes} bytes while it was read"),
        ));
    }
    Ok(buf)
}

/// [`read_regular`] as UTF-8 text.
pub fn read_text(path: &Path, max_bytes: u64, what: &str) -> Result<String> {
    let bytes = read_regular(path, max_bytes, what)?;
    String::from_utf8(bytes).map_err(|e| Error::format(path, format!("{what} is not valid UTF-8: {e}")))
}

/// [`read_text`], or None when the file does not exist (optional files such as
/// `tokenizer_config.json`). Every other failure, a FIFO in its place included, is an error.
pub fn read_text_opt(path: &Path, max_bytes: u64, what: &str) -> Result<Option<String>> {
    match read_text(path, max_bytes, what) {
        Ok(s) => Ok(Some(s)),
        Err(Error::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// A read-only map of a whole file, with the open file it maps. Nothing reads the bytes
/// through the map (a page past the end of a file truncated since would be SIGBUS): every
/// read is a `pread` of the file ([`MappedFile::read_head`], [`MappedFile::read_range`]).
pub struct MappedFile {
    map: Mmap,
    file: File,
    path: PathBuf,
}

impl std::ops::Deref for MappedFile {
    type Target = Mmap;
    fn deref(&self) -> &Mmap {
        &self.map
    }
}

impl MappedFile {
    /// An error when the file is now shorter than its map: reading a mapped page past the
    /// new end would raise SIGBUS and kill the process. An engine build checks this first, so
    /// a file truncated between load and build fails at once, before any weight is read; a
    /// truncation during the build is caught by [`MappedFile::read_range`].
    pub fn check_intact(&self) -> Result<()> {
        self.check_len("since it was loaded (truncated or rewritten in place); load the model again")
    }

    /// Reads `dst.len()` bytes of the file at `offset` into `dst` with `pread`, for
    /// `tensor`'s bytes. Why not from the map: once [`MappedFile::check_intact`] has passed, a
    /// file truncated before the read (a race with the engine build) would make a read of
    /// the map fault with SIGBUS and kill the host; `pread` of a file that shrank returns
    /// short instead, and that is an error naming the file, the tensor and both sizes.
    pub fn read_range(&self, offset: usize, dst: &mut [u8], tensor: &str) -> Result<()> {
        match pread(&self.file, offset as u64, dst) {
            Ok(n) if n == dst.len() => Ok(()),
            Ok(_) => Err(self.shrank_under(tensor, offset, dst.len())),
            Err(e) => Err(Error::bad_tensor(
                &self.path,
                tensor,
                format!("reading bytes {offset}..{} of the file: {e}", offset + dst.len()),
            )),
        }
    }

    /// Reads `dst.len()` bytes at `offset` with `pread` for `what` (a header, a tensor
    /// directory) while a model loads: a loader parses its own copy of the bytes, never the
    /// map, so a file truncated since it was mapped is an error naming it and both sizes,
    /// not a SIGBUS ([`read_exact_at`]).
    pub fn read_head(&self, offset: u64, dst: &mut [u8], what: &str) -> Result<()> {
        read_exact_at(&self.file, &self.path, self.map.len() as u64, offset, dst, what)
    }

    /// [`MappedFile::check_intact`] for a loader that has read what it parses: an error when
    /// the file has shrunk since it was mapped, so a model whose file was truncated while it
    /// loaded fails to load instead of failing later.
    pub fn check_loaded(&self) -> Result<()> {
        self.check_len("while it was being loaded (truncated or rewritten in place)")
    }

    fn check_len(&self, when: &str) -> Result<()> {
        let now = self.file.metadata().map_err(|e| Error::io(&self.path, e))?.len();
        if now < self.map.len() as u64 {
            return Err(Error::format(
                &self.path,
                format!("the file shrank from {} to {now} bytes {when}", self.map.len()),
            ));
        }
        Ok(())
    }

    /// The error for a read of `offset..offset + len` that met the end of the file.
    fn shrank_under(&self, tensor: &str, offset: usize, len: usize) -> Error {
        let now = match self.file.metadata() {
            Ok(m) => format!("{} bytes", m.len()),
            Err(_) => format!("fewer than {} bytes", offset + len),
        };
        Error::bad_tensor(
            &self.path,
            tensor,
            format!(
                "the file shrank from {} to {now} since the model was loaded (truncated or rewritten in \
                 place), so bytes {offset}..{} cannot be read; load the model again",
                self.map.len(),
                offset + len
            ),
        )
    }
}

/// Reads into `dst` at `offset` with `pread` until `dst` is full or the file ends; returns
/// the bytes read (fewer than `dst.len()` only at the end of the file).
fn pread(file: &File, offset: u64, dst: &mut [u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < dst.len() {
        let at = offset + done as u64;
        #[cfg(unix)]
        let got = std::os::unix::fs::FileExt::read_at(file, &mut dst[done..], at);
        #[cfg(windows)]
        let got = std::os::windows::fs::FileExt::seek_read(file, &mut dst[done..], at);
        match got {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Reads `dst.len()` bytes of `file` (`path`, `len` bytes long when it was opened) at
/// `offset` with `pread`, for `what` (`the GGUF header`...). A file that has shrunk so that
/// the bytes are gone is an error naming the file and both sizes.
pub fn read_exact_at(file: &File, path: &Path, len: u64, offset: u64, dst: &mut [u8], what: &str) -> Result<()> {
    let end = offset + dst.len() as u64;
    match pread(file, offset, dst) {
        Ok(n) if n == dst.len() => Ok(()),
        Ok(_) => {
            let now = match file.metadata() {
                Ok(m) => format!("{} bytes", m.len()),
                Err(_) => format!("fewer than {end} bytes"),
            };
            Err(Error::format(
                path,
                format!(
                    "the file shrank from {len} to {now} while it was being loaded (truncated or rewritten in \
                     place), so bytes {offset}..{end} of {what} cannot be read"
                ),
            ))
        }
        Err(e) => {
            Err(Error::io(path, io::Error::new(e.kind(), format!("reading bytes {offset}..{end} of {what}: {e}"))))
        }
    }
}

/// Maps a whole file read-only.
pub fn map_file(path: &Path) -> Result<Arc<MappedFile>> {
    let (file, _) = open_regular(path)?;
    // SAFETY: the map is read-only. A file truncated while mapped makes reads past its new
    // end fault, so tboost never reads through it: `Model::load` parses headers, metadata
    // and tensor directories read with `pread` (`MappedFile::read_head`), and every weight is
    // read with `pread` (`MappedFile::read_range`); the map only names the file's ranges.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    if let Some(hook) = AFTER_MAP.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
        hook(path);
    }
    Ok(Arc::new(MappedFile { map, file, path: path.to_path_buf() }))
}

/// A function [`map_file`] calls with the path of each file it has just mapped.
type AfterMap = Box<dyn Fn(&Path) + Send>;

static AFTER_MAP: std::sync::Mutex<Option<AfterMap>> = std::sync::Mutex::new(None);

/// Test hook, for tests only: `hook` is called with each file's path right after
/// [`map_file`] maps it, before a loader parses anything (`None` removes it). It lets a test
/// change a model file at the one moment a race would (between `Model::load`'s map and its
/// parse); it applies to the whole process.
#[doc(hidden)]
pub fn set_after_map_hook(hook: Option<AfterMap>) {
    *AFTER_MAP.lock().unwrap_or_else(|e| e.into_inner()) = hook;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regular_files_are_read_and_capped() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        std::fs::write(&p, b"{\"a\": 1}").unwrap();
        assert_eq!(read_text(&p, 100, "config.json").unwrap(), "{\"a\": 1}");
        let e = read_text(&p, 4, "config.json").unwrap_err().to_string();
        assert!(e.contains("config.json is 8 bytes") && e.contains("limit of 4"), "{e}");
        assert_eq!(read_text_opt(&dir.path().join("absent.json"), 100, "x").unwrap(), None);
    }

    #[test]
    fn a_read_past_the_end_of_a_file_that_shrank_is_an_error_naming_file_tensor_and_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("model.gguf");
        let bytes: Vec<u8> = (0..3 * 4096u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&p, &bytes).unwrap();
        let map = map_file(&p).unwrap();
        let mut buf = vec![0u8; 5000];
        map.read_range(4000, &mut buf, "blk.0.ffn_up.weight").unwrap();
        assert!(buf[..] == bytes[4000..9000]);
        // Truncated in place: the map still says 12288 bytes, the pages past 4096 are gone
        // (reading them through the map would be SIGBUS).
        std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(4096).unwrap();
        let e = map.read_range(4000, &mut buf, "blk.0.ffn_up.weight").unwrap_err().to_string();
        assert!(e.contains(&p.display().to_string()) && e.contains("tensor `blk.0.ffn_up.weight`"), "{e}");
        assert!(e.contains("shrank from 12288 to 4096 bytes") && e.contains("bytes 4000..9000 cannot be read"), "{e}");
        // What is still in the file reads as before.
        map.read_range(0, &mut buf[..4096], "t").unwrap();
        assert!(buf[..4096] == bytes[..4096]);
    }

    #[test]
    fn directories_and_devices_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let e = open_regular(dir.path()).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        let e = read_text_opt(dir.path(), 100, "x").unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        let e = open_regular(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(e.contains("/dev/zero") && e.contains("a character device"), "{e}");
    }
}
