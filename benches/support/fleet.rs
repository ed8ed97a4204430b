//! The fan-out workload's remote side, shared by the benchmarks: `servers`
//! servers named `s<n>.example`, each with `per_server` users `@u<n>:…`,
//! played by one mock that checks X-Matrix against our key and answers each
//! user's `/user/devices` with two devices after `latency`.

use std::time::Duration;

use device_list_updater::server_key::ServerKey;
use device_list_updater::testkit::remote::{MockFederation, Reply, device_list};

/// The mocked servers and their users.
pub struct Fleet {
    /// The mock playing every server.
    pub mock: MockFederation,
    /// The servers' names.
    pub servers: Vec<String>,
    /// Every user, server by server.
    pub users: Vec<String>,
}

/// Starts the fleet, trusting requests signed with `key` by `our.example`.
pub async fn two_device_fleet(
    key: &ServerKey,
    servers: usize,
    per_server: usize,
    latency: Duration,
) -> Fleet {
    let pair = key.key_pair().expect("key pair");
    let mock =
        MockFederation::start("our.example", key.version(), pair.public_key(), latency).await;
    let servers: Vec<String> = (0..servers).map(|s| format!("s{s}.example")).collect();
    let users: Vec<String> = servers
        .iter()
        .flat_map(|s| (0..per_server).map(move |u| format!("@u{u}:{s}")))
        .collect();
    for user in &users {
        let list = device_list(user, 1, &[("D1", "Phone"), ("D2", "Laptop")]);
        mock.script(user, vec![Reply::Json(list)]);
    }
    Fleet {
        mock,
        servers,
        users,
    }
}
