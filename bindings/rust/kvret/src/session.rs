//! Sessions across conversation turns: the context's session store (`kvret_session_*`).

use std::ffi::CString;

use crate::error::{rust_error, Result, Status};
use crate::sys;

/// Where a saved session is ([`Context::session_tier`](crate::Context::session_tier)); `None` there means it is not
/// stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SessionTier {
    /// Host memory.
    Dram,
    /// The disk tier ([`Config::disk_path`](crate::Config::disk_path)).
    Disk,
    /// Only in the shared tier ([`Config::session_shared_url`](crate::Config::session_shared_url)).
    Shared,
}

impl SessionTier {
    /// The tier of a `kvret_session_tier` code; `None` for `KVRET_TIER_NONE`.
    pub(crate) fn from_code(code: i32) -> Result<Option<SessionTier>> {
        match code {
            sys::KVRET_TIER_NONE => Ok(None),
            sys::KVRET_TIER_DRAM => Ok(Some(SessionTier::Dram)),
            sys::KVRET_TIER_DISK => Ok(Some(SessionTier::Disk)),
            sys::KVRET_TIER_SHARED => Ok(Some(SessionTier::Shared)),
            other => Err(rust_error(Status::Internal, format!("kvret_session_where gave an unknown tier {other}"))),
        }
    }
}

/// A session id for the C call: its bytes (a `&str`'s UTF-8, or any bytes) without a NUL, else status
/// InvalidArgument. Its length (1 to 255 bytes) is the library's to judge, with its message.
pub(crate) fn session_id(id: &[u8], name: &str) -> Result<CString> {
    CString::new(id).map_err(|_| rust_error(Status::InvalidArgument, format!("{name} contains a NUL byte")))
}
