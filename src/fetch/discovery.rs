//! Server discovery for a hostname without a port (server-server spec,
//! "Resolving server names", steps after delegation): SRV
//! `_matrix-fed._tcp.<host>`, then the deprecated `_matrix._tcp.<host>`,
//! then the host itself on port 8448. Every address passes the guard.
//!
//! The choice is [`discover`], generic over a [`Dns`] so it is tested with
//! a fake; [`HickoryDns`] is the real one (system resolver configuration).

use std::future::Future;
use std::net::{IpAddr, SocketAddr};

use super::error::ClientError;
use super::guard;

/// Port used when no SRV record names one.
pub const DEFAULT_PORT: u16 = 8448;

/// One SRV record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SrvRecord {
    /// Lower is tried first.
    pub priority: u16,
    /// Among equal priorities, heavier is tried first.
    pub weight: u16,
    /// Target host (no trailing dot).
    pub target: String,
    /// Target port.
    pub port: u16,
}

/// The DNS questions discovery asks.
pub trait Dns: Send + Sync {
    /// SRV records of `name` (empty when there are none).
    fn srv(&self, name: &str) -> impl Future<Output = Vec<SrvRecord>> + Send;
    /// Addresses of `host` (empty when it does not resolve).
    fn ips(&self, host: &str) -> impl Future<Output = Vec<IpAddr>> + Send;
}

/// What discovery found for a host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Discovered {
    /// Addresses to connect to, in order; only allowed ones.
    pub addrs: Vec<SocketAddr>,
    /// Addresses found but refused by the guard.
    pub refused: Vec<SocketAddr>,
}

/// SRV targets in the order to try them: priority ascending, then weight
/// descending (deterministic, rather than the RFC's weighted random pick:
/// one replica asks a server at a time, so spreading load is moot).
pub fn order_srv(mut records: Vec<SrvRecord>) -> Vec<SrvRecord> {
    records.retain(|r| r.target != "." && !r.target.is_empty());
    records.sort_by(|a, b| a.priority.cmp(&b.priority).then(b.weight.cmp(&a.weight)));
    records
}

/// Where to connect for `host` (a hostname without a port).
pub async fn discover<D: Dns>(dns: &D, host: &str) -> Discovered {
    let mut found: Vec<SocketAddr> = Vec::new();
    for service in ["_matrix-fed._tcp", "_matrix._tcp"] {
        let records = order_srv(dns.srv(&format!("{service}.{host}.")).await);
        if records.is_empty() {
            continue;
        }
        for record in records {
            let target = record.target.trim_end_matches('.');
            for ip in dns.ips(target).await {
                found.push(SocketAddr::new(ip, record.port));
            }
        }
        break;
    }
    if found.is_empty() {
        found = dns
            .ips(host)
            .await
            .into_iter()
            .map(|ip| SocketAddr::new(ip, DEFAULT_PORT))
            .collect();
    }
    let (addrs, refused) = found.into_iter().partition(|a| guard::is_allowed(a.ip()));
    Discovered { addrs, refused }
}

/// DNS through hickory-resolver with the system configuration.
pub struct HickoryDns {
    resolver: hickory_resolver::TokioResolver,
}

impl HickoryDns {
    /// A resolver configured like the system's (`/etc/resolv.conf`).
    pub fn from_system() -> Result<HickoryDns, ClientError> {
        let resolver = hickory_resolver::TokioResolver::builder_tokio()
            .map_err(|e| ClientError::Dns(Box::new(e)))?
            .build()
            .map_err(|e| ClientError::Dns(Box::new(e)))?;
        Ok(HickoryDns { resolver })
    }
}

impl Dns for HickoryDns {
    async fn srv(&self, name: &str) -> Vec<SrvRecord> {
        let Ok(lookup) = self.resolver.srv_lookup(name).await else {
            return Vec::new();
        };
        lookup
            .answers()
            .iter()
            .filter_map(|record| match &record.data {
                hickory_resolver::proto::rr::RData::SRV(srv) => Some(SrvRecord {
                    priority: srv.priority,
                    weight: srv.weight,
                    target: srv.target.to_ascii(),
                    port: srv.port,
                }),
                _ => None,
            })
            .collect()
    }

    async fn ips(&self, host: &str) -> Vec<IpAddr> {
        match self.resolver.lookup_ip(host).await {
            Ok(lookup) => lookup.iter().collect(),
            Err(_) => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[derive(Default)]
    struct FakeDns {
        srv: HashMap<String, Vec<SrvRecord>>,
        ips: HashMap<String, Vec<IpAddr>>,
    }

    impl Dns for FakeDns {
        async fn srv(&self, name: &str) -> Vec<SrvRecord> {
            self.srv.get(name).cloned().unwrap_or_default()
        }
        async fn ips(&self, host: &str) -> Vec<IpAddr> {
            self.ips.get(host).cloned().unwrap_or_default()
        }
    }

    fn srv(priority: u16, weight: u16, target: &str, port: u16) -> SrvRecord {
        SrvRecord {
            priority,
            weight,
            target: target.into(),
            port,
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[tokio::test]
    async fn no_srv_means_port_8448() {
        let mut dns = FakeDns::default();
        dns.ips
            .insert("example.org".into(), vec![ip("93.184.216.34")]);
        let found = discover(&dns, "example.org").await;
        assert_eq!(found.addrs, [addr("93.184.216.34:8448")]);
    }

    #[tokio::test]
    async fn matrix_fed_srv_wins_over_the_legacy_one() {
        let mut dns = FakeDns::default();
        dns.srv.insert(
            "_matrix-fed._tcp.example.org.".into(),
            vec![
                srv(10, 0, "b.example.org.", 443),
                srv(5, 0, "a.example.org.", 8443),
            ],
        );
        dns.srv.insert(
            "_matrix._tcp.example.org.".into(),
            vec![srv(0, 0, "old.example.org.", 1)],
        );
        dns.ips.insert("a.example.org".into(), vec![ip("1.1.1.1")]);
        dns.ips.insert("b.example.org".into(), vec![ip("8.8.8.8")]);
        let found = discover(&dns, "example.org").await;
        assert_eq!(found.addrs, [addr("1.1.1.1:8443"), addr("8.8.8.8:443")]);
    }

    #[tokio::test]
    async fn legacy_srv_is_used_when_alone() {
        let mut dns = FakeDns::default();
        dns.srv.insert(
            "_matrix._tcp.example.org.".into(),
            vec![srv(0, 0, "old.example.org", 8000)],
        );
        dns.ips
            .insert("old.example.org".into(), vec![ip("9.9.9.9")]);
        let found = discover(&dns, "example.org").await;
        assert_eq!(found.addrs, [addr("9.9.9.9:8000")]);
    }

    #[tokio::test]
    async fn refused_addresses_are_dropped_and_reported() {
        let mut dns = FakeDns::default();
        dns.srv.insert(
            "_matrix-fed._tcp.evil.org.".into(),
            vec![srv(0, 0, "internal.evil.org.", 6379)],
        );
        dns.ips.insert(
            "internal.evil.org".into(),
            vec![ip("10.0.0.5"), ip("127.0.0.1")],
        );
        let found = discover(&dns, "evil.org").await;
        assert!(found.addrs.is_empty());
        assert_eq!(
            found.refused,
            [addr("10.0.0.5:6379"), addr("127.0.0.1:6379")]
        );
    }

    #[test]
    fn srv_order() {
        let ordered = order_srv(vec![
            srv(10, 1, "c", 1),
            srv(0, 5, "b", 1),
            srv(0, 50, "a", 1),
            srv(0, 0, ".", 1), // "service not available"
        ]);
        let targets: Vec<&str> = ordered.iter().map(|r| r.target.as_str()).collect();
        assert_eq!(targets, ["a", "b", "c"]);
    }
}
