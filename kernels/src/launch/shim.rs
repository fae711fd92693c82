//! [`Launcher`] on the CPU: the SIMT shim executes the kernels' `.cu` sources (see
//! [`crate::simt`]), and device memory is host memory.

use std::ffi::c_void;

use super::{Arg, Geometry, LaunchError, Launcher, Result, in_bounds};
use crate::simt::{self, Schedule};

/// The SIMT shim as a device, running warps in `schedule`'s order.
#[derive(Debug, Clone, Copy)]
pub struct Shim {
    pub schedule: Schedule,
}

impl Default for Shim {
    fn default() -> Shim {
        Shim {
            schedule: Schedule::Forward,
        }
    }
}

/// Host memory standing in for device memory: 8-byte aligned (as `cudaMalloc`'s is at least),
/// reached by kernels only through its raw pointer, so no Rust reference to the bytes is alive
/// while a kernel writes them.
pub struct ShimBuffer {
    words: *mut u64,
    capacity: usize,
    len: usize,
}

// SAFETY: the buffer owns its allocation; nothing else holds the pointer between calls.
unsafe impl Send for ShimBuffer {}

impl ShimBuffer {
    fn zeroed(len: usize) -> ShimBuffer {
        let capacity = len.div_ceil(8);
        let words = Box::into_raw(vec![0u64; capacity].into_boxed_slice()) as *mut u64;
        ShimBuffer {
            words,
            capacity,
            len,
        }
    }

    fn bytes(&self) -> *mut u8 {
        self.words.cast()
    }
}

impl Drop for ShimBuffer {
    fn drop(&mut self) {
        // SAFETY: `words` came from a boxed slice of `capacity` words, freed only here.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.words,
                self.capacity,
            )));
        }
    }
}

impl Launcher for Shim {
    type Buffer = ShimBuffer;

    fn describe(&self) -> String {
        "the SIMT shim (CUDA sources on the CPU)".to_string()
    }

    fn alloc(&self, bytes: usize) -> Result<ShimBuffer> {
        Ok(ShimBuffer::zeroed(bytes))
    }

    fn write(&self, buffer: &mut ShimBuffer, offset: usize, data: &[u8]) -> Result<()> {
        in_bounds("write", offset, data.len(), buffer.len)?;
        // SAFETY: in bounds, and `data` cannot overlap a buffer it has no pointer to.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), buffer.bytes().add(offset), data.len())
        };
        Ok(())
    }

    fn read(&self, buffer: &ShimBuffer, offset: usize, len: usize) -> Result<Vec<u8>> {
        in_bounds("read", offset, len, buffer.len)?;
        let mut out = vec![0u8; len];
        // SAFETY: in bounds; launches are synchronous, so no kernel is writing.
        unsafe { std::ptr::copy_nonoverlapping(buffer.bytes().add(offset), out.as_mut_ptr(), len) };
        Ok(out)
    }

    unsafe fn launch(
        &self,
        name: &str,
        geometry: Geometry,
        args: &[Arg<'_, ShimBuffer>],
    ) -> Result<()> {
        let pointer = |buffer: &ShimBuffer, offset: usize| {
            in_bounds(name, offset, 0, buffer.len)?;
            // SAFETY: at most one past the end, checked above.
            Ok(unsafe { buffer.bytes().add(offset) } as u64)
        };
        let slots = args
            .iter()
            .map(|a| a.slot(pointer))
            .collect::<Result<Vec<u64>>>()?;
        let params: Vec<*mut c_void> = slots.iter().map(simt::arg).collect();
        // SAFETY: the caller vouches for the arguments' types and the buffers' sizes.
        unsafe { simt::launch(name, geometry.grid, geometry.block, self.schedule, &params) }
            .map_err(LaunchError)
    }

    fn len(&self, buffer: &ShimBuffer) -> usize {
        buffer.len
    }
}
