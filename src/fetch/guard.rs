//! The outbound guard (SPEC §5.2): addresses a fetch must never connect to.
//! Discovery answers come from remote servers and their DNS, so without this
//! a remote user id like `@evil:127.0.0.1:6379` would make us talk to our own
//! loopback or private network.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Whether `ip` is a globally routable unicast address we may connect to.
pub fn is_allowed(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4_allowed(v4),
        IpAddr::V6(v6) => v6_allowed(v6),
    }
}

fn v4_allowed(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_multicast()
        || ip.is_broadcast()
        || ip.is_documentation()
        || a == 0 // "this network"
        || (a == 100 && (64..128).contains(&b)) // shared address space (CGNAT)
        || (a == 192 && b == 0 && c == 0) // IETF protocol assignments
        || (a == 198 && (b == 18 || b == 19)) // benchmarking
        || a >= 240) // reserved
}

fn v6_allowed(ip: Ipv6Addr) -> bool {
    if let Some(v4) = ip.to_ipv4_mapped() {
        return v4_allowed(v4);
    }
    let segments = ip.segments();
    // NAT64 (64:ff9b::/96) reaches the embedded IPv4 address.
    if segments[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        let [a, b] = segments[6].to_be_bytes();
        let [c, d] = segments[7].to_be_bytes();
        return v4_allowed(Ipv4Addr::new(a, b, c, d));
    }
    !(ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_multicast()
        || (segments[0] & 0xfe00) == 0xfc00 // unique local
        || (segments[0] & 0xffc0) == 0xfe80 // link local
        || (segments[0] & 0xffc0) == 0xfec0 // site local (deprecated)
        || (segments[0] == 0x2001 && segments[1] == 0x0db8) // documentation
        || segments[..4] == [0x100, 0, 0, 0] // discard only
        || segments[..6] == [0, 0, 0, 0, 0, 0]) // IPv4-compatible (deprecated), ::/96
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table() {
        let table = [
            ("8.8.8.8", true),
            ("1.1.1.1", true),
            ("2001:4860:4860::8888", true),
            ("::ffff:8.8.8.8", true),
            ("64:ff9b::808:808", true),
            ("127.0.0.1", false),
            ("127.9.9.9", false),
            ("10.1.2.3", false),
            ("172.16.0.1", false),
            ("192.168.1.1", false),
            ("169.254.169.254", false), // cloud metadata
            ("100.64.0.1", false),
            ("0.0.0.0", false),
            ("0.1.2.3", false),
            ("224.0.0.1", false),
            ("255.255.255.255", false),
            ("192.0.2.1", false),
            ("198.18.0.1", false),
            ("240.0.0.1", false),
            ("192.0.0.8", false),
            ("::1", false),
            ("::", false),
            ("fe80::1", false),
            ("fc00::1", false),
            ("fd12:3456::1", false),
            ("ff02::1", false),
            ("2001:db8::1", false),
            ("::ffff:127.0.0.1", false),
            ("::ffff:10.0.0.1", false),
            ("64:ff9b::7f00:1", false),
            ("::127.0.0.1", false),
            ("100::1", false),
            ("fec0::1", false),
        ];
        for (text, allowed) in table {
            let ip: IpAddr = text.parse().unwrap();
            assert_eq!(is_allowed(ip), allowed, "{text}");
        }
    }
}
