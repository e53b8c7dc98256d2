//! Typed conveniences over the byte-level `Backend::read`/`write`.

use super::{Backend, View};
use crate::{Error, Result};

/// Plain old data that crosses to a device as its little-endian bytes.
pub trait Pod: Copy + Default + 'static {}
impl Pod for f32 {}
impl Pod for u32 {}
impl Pod for i32 {}
impl Pod for u8 {}
impl Pod for i8 {}

fn as_bytes<T: Pod>(v: &[T]) -> &[u8] {
    // SAFETY: `Pod` types have no padding and every bit pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

fn as_bytes_mut<T: Pod>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: as above; any byte pattern written is a valid value of these types.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

pub trait BackendExt: Backend {
    /// Writes `src` into `dst`, checking the element size against the buffer's dtype.
    fn write_typed<T: Pod>(&mut self, dst: View, src: &[T]) -> Result<()> {
        check::<T>(self, dst, src.len())?;
        self.write(dst, as_bytes(src))
    }

    fn write_typed_async<T: Pod>(&mut self, dst: View, src: &[T]) -> Result<()> {
        check::<T>(self, dst, src.len())?;
        self.write_async(dst, as_bytes(src))
    }

    /// Reads `src` into `dst`, checking the element size against the buffer's dtype.
    fn read_typed<T: Pod>(&mut self, src: View, dst: &mut [T]) -> Result<()> {
        check::<T>(self, src, dst.len())?;
        self.read(src, as_bytes_mut(dst))
    }
}

impl<B: Backend + ?Sized> BackendExt for B {}

fn check<T: Pod>(be: &(impl Backend + ?Sized), v: View, n: usize) -> Result<()> {
    let (dtype, _) = be
        .buffer(v.buf)
        .ok_or_else(|| Error::Backend { backend: be.name().into(), msg: format!("unknown buffer {}", v.buf.0) })?;
    if dtype.block_elems() != 1 || dtype.block_bytes() != std::mem::size_of::<T>() || n != v.len {
        return Err(Error::Backend {
            backend: be.name().into(),
            msg: format!(
                "typed copy of {n} elements of {} bytes into a view of {} {dtype} (a bug in the caller)",
                std::mem::size_of::<T>(),
                v.len
            ),
        });
    }
    Ok(())
}
