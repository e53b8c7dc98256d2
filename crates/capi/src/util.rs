//! Copying across the boundary: C strings and arrays in, caller-owned buffers out, and
//! `struct_size`-versioned structs both ways. Every helper checks NULL and names the
//! parameter in its error.

use std::ffi::CStr;
use std::os::raw::c_char;

use super::status::{Failure, FfiResult, Status};

/// Writes `s` NUL-terminated into `buf` (capacity `cap` bytes) and its full size into
/// `*needed`. Too small: writes the longest prefix that fits (cut at a UTF-8 boundary) and
/// fails with `BUFFER_TOO_SMALL`. `buf` may be NULL only with `cap == 0` (a size query).
///
/// # Safety
/// `buf` must be NULL or point to `cap` writable bytes; `needed` NULL or valid.
pub(crate) unsafe fn write_str(s: &str, buf: *mut c_char, cap: usize, needed: *mut usize) -> FfiResult {
    let need = s.len() + 1;
    if !needed.is_null() {
        // SAFETY: non-null and valid per the contract.
        unsafe { needed.write(need) };
    }
    if cap > 0 && buf.is_null() {
        return Err(Failure::null("buf"));
    }
    let mut n = s.len().min(cap.saturating_sub(1));
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    if cap > 0 {
        // SAFETY: `n + 1 <= cap` bytes are writable at `buf`.
        unsafe {
            std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), n);
            buf.add(n).write(0);
        }
    }
    if cap < need {
        return Err(Failure::new(
            Status::TBOOST_ERR_BUFFER_TOO_SMALL,
            format!("the buffer of {cap} bytes is too small: {need} bytes are needed (with the NUL)"),
        ));
    }
    Ok(())
}

/// Copies `items` into the caller's array `out` of `cap` elements; `*count` receives
/// `items.len()` either way. Too small: nothing is written and `BUFFER_TOO_SMALL` is returned.
///
/// # Safety
/// `out` must be NULL or point to `cap` writable elements; `count` NULL or valid.
pub(crate) unsafe fn write_array<T: Copy>(
    items: &[T],
    out: *mut T,
    cap: usize,
    count: *mut usize,
    what: &str,
) -> FfiResult {
    if !count.is_null() {
        // SAFETY: non-null and valid per the contract.
        unsafe { count.write(items.len()) };
    }
    if cap < items.len() {
        return Err(Failure::new(
            Status::TBOOST_ERR_BUFFER_TOO_SMALL,
            format!("the array of {cap} elements is too small: {what} needs {}", items.len()),
        ));
    }
    if items.is_empty() {
        return Ok(());
    }
    if out.is_null() {
        return Err(Failure::null(what));
    }
    // SAFETY: `items.len() <= cap` elements are writable at `out`.
    unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), out, items.len()) };
    Ok(())
}

/// Writes `v` to a required output pointer.
///
/// # Safety
/// `p` must be NULL or valid for writes.
pub(crate) unsafe fn write_out<T>(p: *mut T, v: T) {
    if !p.is_null() {
        // SAFETY: non-null and valid per the contract.
        unsafe { p.write(v) };
    }
}

/// Fails with `NULL_POINTER` naming `param` when `p` is NULL.
pub(crate) fn require<T>(p: *const T, param: &str) -> FfiResult {
    if p.is_null() {
        Err(Failure::null(param))
    } else {
        Ok(())
    }
}

/// A NUL-terminated UTF-8 string argument.
///
/// # Safety
/// `p` must be NULL or point to a NUL-terminated string that outlives the call.
pub(crate) unsafe fn read_cstr<'a>(p: *const c_char, param: &str) -> FfiResult<&'a str> {
    require(p, param)?;
    // SAFETY: non-null and NUL-terminated per the contract.
    let c = unsafe { CStr::from_ptr(p) };
    c.to_str().map_err(|e| Failure::invalid(format!("`{param}` is not valid UTF-8: {e}")))
}

/// An array argument of `n` elements; NULL is allowed when `n == 0`.
///
/// # Safety
/// `p` must be NULL or point to `n` readable elements that outlive the call.
pub(crate) unsafe fn read_slice<'a, T>(p: *const T, n: usize, param: &str) -> FfiResult<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    require(p, param)?;
    if n.checked_mul(std::mem::size_of::<T>()).is_none_or(|b| b > isize::MAX as usize) {
        return Err(Failure::invalid(format!("`{param}`: {n} elements is not a possible array length")));
    }
    // SAFETY: non-null, `n` elements readable per the contract, size checked above.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// Token ids from C (`int32_t`) as engine ids, rejecting negatives by index.
pub(crate) fn token_ids(v: &[i32], param: &str) -> FfiResult<Vec<u32>> {
    v.iter()
        .enumerate()
        .map(|(i, &t)| u32::try_from(t).map_err(|_| Failure::invalid(format!("`{param}[{i}]` = {t} is negative"))))
        .collect()
}

/// Reads a caller-filled struct whose first field is `uint32_t struct_size`: at most
/// `size_of::<T>()` bytes over `default`, so a caller built against an older header leaves
/// the newer fields at their defaults. `min` is the size of the struct's first version.
///
/// # Safety
/// `p` must be NULL or point to at least `struct_size` readable bytes.
pub(crate) unsafe fn read_sized<T: Copy>(p: *const T, mut default: T, min: usize, param: &str) -> FfiResult<T> {
    require(p, param)?;
    // SAFETY: every versioned struct starts with a u32; `p` is non-null.
    let size = unsafe { p.cast::<u32>().read_unaligned() } as usize;
    check_size(size, min, param)?;
    let n = size.min(std::mem::size_of::<T>());
    // SAFETY: `n` bytes are readable at `p` (n <= struct_size) and writable in `default`
    // (n <= size_of::<T>()); T is plain old data (repr(C), Copy).
    unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), (&mut default as *mut T).cast::<u8>(), n) };
    Ok(default)
}

/// Writes `v` into a caller struct of `size` bytes whose first field is `struct_size`:
/// at most `size_of::<T>()` bytes, then `struct_size` = the bytes written.
///
/// # Safety
/// `p` must point to `size >= 4` writable bytes.
pub(crate) unsafe fn write_sized<T: Copy>(p: *mut u8, v: &T, size: usize) {
    let n = size.min(std::mem::size_of::<T>());
    // SAFETY: `n` bytes readable in `v` and writable at `p`.
    unsafe {
        std::ptr::copy_nonoverlapping((v as *const T).cast::<u8>(), p, n);
        p.cast::<u32>().write_unaligned(n as u32);
    }
}

pub(crate) fn check_size(size: usize, min: usize, param: &str) -> FfiResult {
    if size < min {
        return Err(Failure::invalid(format!(
            "`{param}` size is {size} bytes, below the {min} bytes of its first version: set `struct_size` \
             (or the size argument) to sizeof(...) from tboost.h"
        )));
    }
    Ok(())
}
