//! A TCP proxy between the worker and nats-server that can swallow what the
//! server sends, as the socket of a node that is dying does, and then cut
//! every connection, as its death does. New connections pass unharmed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A running proxy; it stops when dropped.
pub struct Proxy {
    addr: SocketAddr,
    swallow: Arc<AtomicBool>,
    cuts: watch::Sender<u64>,
    /// How many connections have subscribed to something so far.
    subscribed: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `upstream`
    /// (`nats://host:port`).
    pub async fn start(upstream: &str) -> Proxy {
        let upstream = upstream
            .strip_prefix("nats://")
            .unwrap_or(upstream)
            .to_owned();
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let swallow = Arc::new(AtomicBool::new(false));
        let (cuts, _) = watch::channel(0);
        let (subscribed, _) = watch::channel(0);
        let task = tokio::spawn({
            let swallow = swallow.clone();
            let cuts = cuts.clone();
            let subscribed = subscribed.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    let Ok(server) = TcpStream::connect(&upstream).await else {
                        continue;
                    };
                    tokio::spawn(forward(
                        client,
                        server,
                        swallow.clone(),
                        cuts.subscribe(),
                        subscribed.clone(),
                    ));
                }
            }
        });
        Proxy {
            addr,
            swallow,
            cuts,
            subscribed,
            task,
        }
    }

    /// The URL clients connect to.
    pub fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    /// From now on, drops everything the server sends, while what clients
    /// send still reaches it.
    pub fn swallow_what_the_server_sends(&self) {
        self.swallow.store(true, Ordering::SeqCst);
    }

    /// How many connections have subscribed to something so far (a client
    /// that reconnects subscribes again to what it had).
    pub fn subscribed_connections(&self) -> u64 {
        *self.subscribed.borrow()
    }

    /// Waits (at most 10 s) until more than `seen` connections have
    /// subscribed: a client cut off has reconnected and subscribed again.
    pub async fn wait_subscribed_after(&self, seen: u64) {
        let mut subscribed = self.subscribed.subscribe();
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            subscribed.wait_for(|n| *n > seen),
        )
        .await
        .expect("a client subscribed again within 10 s")
        .expect("proxy running");
    }

    /// Closes every open connection and stops swallowing: clients reconnect
    /// to a connection that works.
    pub fn cut(&self) {
        self.cuts.send_modify(|n| *n += 1);
        self.swallow.store(false, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
        self.cut();
    }
}

/// Copies both ways until either side closes or the proxy cuts.
async fn forward(
    client: TcpStream,
    server: TcpStream,
    swallow: Arc<AtomicBool>,
    mut cuts: watch::Receiver<u64>,
    subscribed: watch::Sender<u64>,
) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upstream = async {
        let mut buf = vec![0u8; 64 * 1024];
        let mut counted = false;
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if server_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
            // Counted once what carried it reached the server. A `SUB` split
            // across two reads is missed; the client's next one is not.
            if !counted && buf[..n].windows(4).any(|w| w == b"SUB ") {
                counted = true;
                subscribed.send_modify(|n| *n += 1);
            }
        }
    };
    let downstream = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if swallow.load(Ordering::SeqCst) {
                continue;
            }
            if client_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        biased;
        _ = cuts.changed() => {}
        () = upstream => {}
        () = downstream => {}
    }
}
