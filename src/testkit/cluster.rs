//! A NATS cluster on loopback for the fault tests: three (or more)
//! nats-server processes with JetStream, routes between them, one cluster
//! name, each with its own port, store and server name, so streams can run
//! with three replicas and a node can be killed (SIGKILL) and started again
//! on the same store.

use std::time::Duration;

use async_nats::jetstream;

use super::{Nats, wait_for};

/// The cluster's name.
const NAME: &str = "dlu-test";

/// Nodes with routes to each other; stopped when dropped.
pub struct NatsCluster {
    /// The nodes, `n0`, `n1`, … by index.
    pub nodes: Vec<Nats>,
}

/// A free loopback port (for the routes, which must be known up front).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

impl NatsCluster {
    /// Starts `size` nodes and waits until JetStream has a meta leader and
    /// every node answers JetStream requests. The route ports are chosen
    /// free, then given up until the nodes bind them: when another process
    /// took one meanwhile, a node exits, and the cluster starts again on
    /// new ports.
    pub async fn start(size: usize) -> NatsCluster {
        const ATTEMPTS: usize = 5;
        let mut attempt = 1;
        let nodes = loop {
            match NatsCluster::try_nodes(size).await {
                Ok(nodes) => break nodes,
                Err(e) if attempt < ATTEMPTS => {
                    eprintln!("NATS cluster start {attempt} of {ATTEMPTS} failed; new ports: {e}");
                    attempt += 1;
                }
                Err(e) => panic!("the NATS cluster did not start in {ATTEMPTS} attempts: {e}"),
            }
        };
        let cluster = NatsCluster { nodes };
        for node in &cluster.nodes {
            let js = node.js().await;
            wait_for(
                Duration::from_secs(30),
                "JetStream in the cluster",
                || async { js.query_account().await.ok().map(|_| ()) },
            )
            .await;
        }
        cluster
    }

    /// `size` nodes routed to each other on free ports, or why one exited.
    async fn try_nodes(size: usize) -> Result<Vec<Nats>, String> {
        let routes: Vec<u16> = (0..size).map(|_| free_port()).collect();
        let all_routes = routes
            .iter()
            .map(|port| format!("nats-route://127.0.0.1:{port}"))
            .collect::<Vec<_>>()
            .join(", ");
        let mut nodes = Vec::new();
        for (i, port) in routes.iter().enumerate() {
            let conf = format!(
                "server_name: n{i}\ncluster {{ name: {NAME}, listen: \"127.0.0.1:{port}\", routes: [{all_routes}] }}\n"
            );
            nodes.push(Nats::try_start_with_config(&conf).await?);
        }
        Ok(nodes)
    }

    /// Every node's URL, comma-separated (as `DLU_NATS_URL` takes them).
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(|n| n.url.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// A client that knows every node, and its JetStream context.
    pub async fn js(&self) -> jetstream::Context {
        let urls: Vec<String> = self.nodes.iter().map(|n| n.url.clone()).collect();
        let client = async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connect(urls)
            .await
            .expect("connect to the cluster");
        jetstream::new(client)
    }

    /// Creates `DEVICE_LIST_INPUT` with a replica on every node, as the
    /// homeserver would on a cluster (the worker never changes a stream it
    /// finds); retried while the cluster is still placing streams.
    pub async fn create_input_stream(&self, js: &jetstream::Context) {
        wait_for(Duration::from_secs(30), "the input stream", || async {
            js.get_or_create_stream(jetstream::stream::Config {
                name: "DEVICE_LIST_INPUT".into(),
                subjects: vec!["devicelist.in.>".into()],
                num_replicas: self.nodes.len(),
                ..Default::default()
            })
            .await
            .ok()
            .map(|_| ())
        })
        .await;
    }

    /// The index of the node leading `stream`, once it has a leader.
    pub async fn leader_of(&self, js: &jetstream::Context, stream: &str) -> usize {
        wait_for(Duration::from_secs(30), "a stream leader", || async {
            let mut s = js.get_stream(stream).await.ok()?;
            let leader = s.info().await.ok()?.cluster.clone()?.leader?;
            let index: usize = leader.strip_prefix('n')?.parse().ok()?;
            (index < self.nodes.len()).then_some(index)
        })
        .await
    }

    /// Waits until `stream` has a leader and every replica is current (a
    /// node started again has caught up).
    pub async fn wait_all_current(&self, js: &jetstream::Context, stream: &str) {
        wait_for(Duration::from_secs(60), "every replica current", || async {
            let mut s = js.get_stream(stream).await.ok()?;
            let cluster = s.info().await.ok()?.cluster.clone()?;
            cluster.leader.as_ref()?;
            let replicas = cluster.replicas.len() + 1;
            let current = cluster.replicas.iter().all(|r| r.current && !r.offline);
            (current && replicas == self.nodes.len()).then_some(())
        })
        .await;
    }
}
