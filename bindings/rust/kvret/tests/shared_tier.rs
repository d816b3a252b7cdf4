//! The shared session tier: two contexts on one redis-server (started per test; skipped where none is installed).

mod common;

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use kvret::{Context, SessionTier, Status};

/// A redis-server on a free port, stopped on drop.
struct Server {
    child: Child,
    url: String,
    dir: std::path::PathBuf,
}

impl Server {
    fn start() -> Option<Server> {
        let port = TcpListener::bind("127.0.0.1:0").ok()?.local_addr().ok()?.port();
        let dir = std::env::temp_dir().join(format!("kvret-rust-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let mut server = Server { child, url: format!("redis://127.0.0.1:{port}/0?prefix=kvret-rust-{port}"), dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline || server.child.try_wait().ok().flatten().is_some() {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(server)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn another_context_opens_what_one_saved() {
    let Some(server) = Server::start() else {
        eprintln!("skipped: no redis-server could be started");
        return;
    };
    let config = config().session_shared_url(Some(&server.url));
    let (a, b) = (Context::new(&config).unwrap(), Context::new(&config).unwrap());
    assert_eq!(a.config().session_shared_url_str(), Some(server.url.as_str()));
    let mut rng = Rng(31);
    let mut seq = a.open_sequence().unwrap();
    for layer in 0..LAYERS {
        let (k, v) = kv(&mut rng);
        seq.append_prefill(layer, &k, &v).unwrap();
    }
    seq.save_session("shared-1").unwrap();
    a.flush_sessions().unwrap();
    assert_eq!(b.session_tier("shared-1").unwrap(), Some(SessionTier::Shared));
    let reopened = b.open_session("shared-1").unwrap().expect("a session in the shared tier");
    for layer in 0..LAYERS {
        assert_eq!(reopened.read::<f32>(layer, 0..TOKENS).unwrap(), seq.read::<f32>(layer, 0..TOKENS).unwrap());
    }
    drop(reopened);
    assert!(b.open_session("never-saved").unwrap().is_none());
    assert!(b.drop_session("shared-1").unwrap());
    assert_eq!(b.session_tier("shared-1").unwrap(), None);
}

#[test]
fn malformed_urls_are_refused_by_name() {
    for url in ["http://127.0.0.1:6379", "redis://127.0.0.1:99999", "redis://"] {
        let error = Context::new(&config().session_shared_url(Some(url))).expect_err(url);
        assert_eq!(error.status(), Status::InvalidArgument, "{error}");
        assert!(error.message().contains("session_shared_url"), "{error}");
    }
}
