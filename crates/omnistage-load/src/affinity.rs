//! CPU pinning of generator threads (`--cpu`), so the generator can sit beside the server on a
//! known core. The only `unsafe` in the crate lives here.

/// Number of CPUs a `cpu_set_t` can name; CPU indices must be below it.
#[cfg(target_os = "linux")]
pub const MAX_CPU_INDEX_EXCLUSIVE: usize = libc::CPU_SETSIZE as usize;
#[cfg(not(target_os = "linux"))]
pub const MAX_CPU_INDEX_EXCLUSIVE: usize = 1024;

/// Pins the calling thread to CPU `cpu`.
#[cfg(target_os = "linux")]
pub fn pin_current_thread(cpu: usize) -> Result<(), String> {
    if cpu >= MAX_CPU_INDEX_EXCLUSIVE {
        return Err(format!(
            "--cpu {cpu}: CPU index must be below {MAX_CPU_INDEX_EXCLUSIVE}"
        ));
    }
    // SAFETY: `cpu_set_t` is a plain bit array, for which all-zero bytes is the valid empty set.
    // `CPU_SET` writes bit `cpu` inside that array, which exists because `cpu < CPU_SETSIZE` was
    // checked above. `sched_setaffinity` reads exactly `size_of::<cpu_set_t>()` bytes from a
    // reference to a live local, and pid 0 means the calling thread; it does not retain the
    // pointer.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Err(format!(
            "--cpu {cpu}: cannot pin the generator thread there: {e}"
        ));
    }
    Ok(())
}

/// Pinning is implemented for Linux only.
#[cfg(not(target_os = "linux"))]
pub fn pin_current_thread(cpu: usize) -> Result<(), String> {
    Err(format!(
        "--cpu {cpu}: CPU pinning is supported on Linux only"
    ))
}
