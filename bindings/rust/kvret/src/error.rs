use std::ffi::CStr;
use std::fmt;

use crate::sys;

/// What a failed call reports (`kvret_status` without `KVRET_OK`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Status {
    InvalidArgument,
    InvalidHandle,
    Shape,
    Dtype,
    Stride,
    Device,
    OutOfRange,
    Budget,
    Capacity,
    OutOfMemory,
    Nonfinite,
    State,
    Unsupported,
    Io,
    Corrupt,
    Cuda,
    Version,
    Internal,
    NotFound,
    /// The sequence is in a call on another thread; nothing was done.
    Busy,
    /// A status this version of the crate does not know.
    Unknown(i32),
}

const STATUSES: [(Status, sys::kvret_status); 20] = [
    (Status::InvalidArgument, sys::KVRET_ERR_INVALID_ARGUMENT),
    (Status::InvalidHandle, sys::KVRET_ERR_INVALID_HANDLE),
    (Status::Shape, sys::KVRET_ERR_SHAPE),
    (Status::Dtype, sys::KVRET_ERR_DTYPE),
    (Status::Stride, sys::KVRET_ERR_STRIDE),
    (Status::Device, sys::KVRET_ERR_DEVICE),
    (Status::OutOfRange, sys::KVRET_ERR_OUT_OF_RANGE),
    (Status::Budget, sys::KVRET_ERR_BUDGET),
    (Status::Capacity, sys::KVRET_ERR_CAPACITY),
    (Status::OutOfMemory, sys::KVRET_ERR_OUT_OF_MEMORY),
    (Status::Nonfinite, sys::KVRET_ERR_NONFINITE),
    (Status::State, sys::KVRET_ERR_STATE),
    (Status::Unsupported, sys::KVRET_ERR_UNSUPPORTED),
    (Status::Io, sys::KVRET_ERR_IO),
    (Status::Corrupt, sys::KVRET_ERR_CORRUPT),
    (Status::Cuda, sys::KVRET_ERR_CUDA),
    (Status::Version, sys::KVRET_ERR_VERSION),
    (Status::Internal, sys::KVRET_ERR_INTERNAL),
    (Status::NotFound, sys::KVRET_ERR_NOT_FOUND),
    (Status::Busy, sys::KVRET_ERR_BUSY),
];

impl Status {
    /// The status of a non-OK `kvret_status` code.
    pub fn from_code(code: sys::kvret_status) -> Status {
        STATUSES.iter().find(|(_, c)| *c == code).map_or(Status::Unknown(code), |(s, _)| *s)
    }

    /// The numeric `kvret_status`.
    pub fn code(self) -> sys::kvret_status {
        match self {
            Status::Unknown(code) => code,
            known => STATUSES.iter().find(|(s, _)| *s == known).unwrap().1,
        }
    }

    /// The library's name for the status ("KVRET_ERR_SHAPE", ...).
    pub fn name(self) -> &'static str {
        // SAFETY: kvret_status_string returns a static NUL-terminated string for any value.
        unsafe { CStr::from_ptr(sys::kvret_status_string(self.code())) }.to_str().unwrap_or("KVRET_ERR_?")
    }
}

/// A failed kvret call: the status and the library's message (`kvret_last_error`), or this crate's message for a
/// check made before calling into the library (e.g. a slice of the wrong length).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvretError {
    status: Status,
    message: String,
}

impl KvretError {
    pub(crate) fn new(status: Status, message: impl Into<String>) -> Self {
        KvretError { status, message: message.into() }
    }

    pub fn status(&self) -> Status {
        self.status
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for KvretError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}] {}", self.status.name(), self.message)
    }
}

impl std::error::Error for KvretError {}

pub type Result<T> = std::result::Result<T, KvretError>;

/// Ok for KVRET_OK; otherwise the error with this thread's last-error message, read right after the call.
pub(crate) fn check(code: sys::kvret_status) -> Result<()> {
    if code == sys::KVRET_OK {
        return Ok(());
    }
    // SAFETY: kvret_last_error returns a NUL-terminated thread-local string, valid until the next kvret call.
    let message = unsafe { CStr::from_ptr(sys::kvret_last_error()) }.to_string_lossy().into_owned();
    Err(KvretError::new(Status::from_code(code), message))
}

/// An error found by this crate before calling into the library.
pub(crate) fn rust_error(status: Status, message: impl fmt::Display) -> KvretError {
    KvretError::new(status, format!("kvret (rust): {message}"))
}

pub(crate) fn shape_error(message: impl fmt::Display) -> KvretError {
    rust_error(Status::Shape, message)
}
