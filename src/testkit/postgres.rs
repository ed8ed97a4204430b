//! A private PostgreSQL instance for tests that stop the server itself:
//! `initdb` into a temporary directory with the machine's PostgreSQL
//! binaries, its own port, stopped with `pg_ctl stop -m immediate` (a crash
//! as far as clients can tell) and started again on the same data.
//!
//! PostgreSQL refuses to run as root; when the tests run as root, the
//! instance runs as the `postgres` system user (`runuser`).
//!
//! [`PrivatePostgres::start_with_tls`] gives an instance that takes TCP
//! connections over TLS only, for the `sslmode` tests.

use std::io::Write as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A private PostgreSQL server; stopped when dropped.
pub struct PrivatePostgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    port: u16,
    /// `postgres://postgres@127.0.0.1:<port>/postgres`.
    pub url: String,
}

/// The directory of `initdb` and `pg_ctl`: `PG_BIN`, else the newest
/// `/usr/lib/postgresql/<version>/bin`, else the `PATH`.
fn binaries() -> PathBuf {
    if let Ok(bin) = std::env::var("PG_BIN") {
        return PathBuf::from(bin);
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path().join("bin"))
        .filter(|bin| bin.join("initdb").exists())
        .collect();
    versions.sort();
    versions.pop().unwrap_or_default()
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| out.stdout.starts_with(b"0\n"))
}

impl PrivatePostgres {
    /// Creates and starts an instance on a free port.
    pub fn start() -> PrivatePostgres {
        let pg = PrivatePostgres::create();
        pg.start_again();
        pg
    }

    /// Creates and starts an instance that accepts TCP connections only
    /// over TLS (`ssl = on`, `hostssl` lines alone in `pg_hba.conf`), with
    /// the server certificate `cert` and its key `key` (PEM files).
    pub fn start_with_tls(cert: &Path, key: &Path) -> PrivatePostgres {
        let pg = PrivatePostgres::create();
        let (server_cert, server_key) = (
            pg.dir.path().join("server.crt"),
            pg.dir.path().join("server.key"),
        );
        std::fs::copy(cert, &server_cert).expect("copy the certificate");
        std::fs::copy(key, &server_key).expect("copy the key");
        // PostgreSQL refuses a key others can read.
        std::fs::set_permissions(&server_key, std::fs::Permissions::from_mode(0o600))
            .expect("chmod the key");
        pg.give_to_postgres(&[&server_cert, &server_key]);
        let data = pg.dir.path().join("data");
        let mut conf = std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .expect("postgresql.conf");
        writeln!(
            conf,
            "ssl = on\nssl_cert_file = '{}'\nssl_key_file = '{}'",
            server_cert.display(),
            server_key.display()
        )
        .expect("write postgresql.conf");
        std::fs::write(
            data.join("pg_hba.conf"),
            "local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
        )
        .expect("write pg_hba.conf");
        pg.start_again();
        pg
    }

    /// The directory the instance keeps its data, log and files in.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// An instance created (`initdb`) but not started.
    fn create() -> PrivatePostgres {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let pg = PrivatePostgres {
            bin: binaries(),
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            port,
            dir,
        };
        if is_root() {
            let status = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(pg.dir.path())
                .status()
                .expect("chown");
            assert!(status.success(), "chown the data directory to postgres");
        }
        let data = pg.data();
        pg.run("initdb", &["-U", "postgres", "--auth=trust", "-D", &data]);
        pg
    }

    /// Files the server must own (it runs as `postgres` when we are root).
    fn give_to_postgres(&self, files: &[&Path]) {
        if !is_root() {
            return;
        }
        let status = Command::new("chown")
            .arg("postgres:postgres")
            .args(files)
            .status()
            .expect("chown");
        assert!(status.success(), "chown {files:?} to postgres");
    }

    fn data(&self) -> String {
        self.dir.path().join("data").display().to_string()
    }

    /// One of the PostgreSQL binaries, run as `postgres` when we are root.
    fn command(&self, binary: &str) -> Command {
        let program = self.bin.join(binary);
        if is_root() {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(&program);
            command
        } else {
            Command::new(&program)
        }
    }

    /// Runs one of the PostgreSQL binaries; panics if it fails.
    fn run(&self, binary: &str, args: &[&str]) {
        let output = self
            .command(binary)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{binary} cannot run: {e}"));
        assert!(
            output.status.success(),
            "{binary} {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// Starts the server (again) on the same port and data; returns once it
    /// accepts connections.
    pub fn start_again(&self) {
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {}",
            self.port,
            self.dir.path().display()
        );
        let data = self.data();
        let log = self.dir.path().join("server.log").display().to_string();
        self.run(
            "pg_ctl",
            &["start", "-w", "-D", &data, "-l", &log, "-o", &options],
        );
    }

    /// Stops the server the way a crash would: `pg_ctl stop -m immediate`
    /// (no checkpoint, clients cut off).
    pub fn stop_immediate(&self) {
        let data = self.data();
        self.run("pg_ctl", &["stop", "-m", "immediate", "-D", &data]);
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let data = self.data();
        let _ = self
            .command("pg_ctl")
            .args(["stop", "-m", "immediate", "-D", &data])
            .output();
    }
}
