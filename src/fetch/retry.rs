//! Whose failure a failed fetch is, and how long to wait after it (SPEC
//! §5.2), as pure functions with table tests.
//!
//! - [`blame`]: a failure that is the server's (no answer, 5xx, 429, 401)
//!   backs off the server; one that is a single user's (the server answered,
//!   but not with a usable list for that user) backs off that user alone.
//! - [`RetryPolicy::wait`]: `DLU_RETRY_MIN · 2^(failures−1)` capped at
//!   `DLU_RETRY_MAX`, or the remote's asked wait if longer; both are floors,
//!   and the random spread only lengthens them.
//!
//! Built on `backon`'s exponential builder. The `backoff` crate is
//! unmaintained (RUSTSEC-2025-0012, and its `instant` dependency
//! RUSTSEC-2024-0384); `backon` is its maintained successor and computes
//! delays as a plain iterator, without running a retry loop.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

/// What went wrong with one request for one user's list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// No HTTP answer: DNS, connection, TLS, timeout, a refused address, an
    /// answer cut off while it was read.
    Unreachable,
    /// The server answered with this status (anything but 2xx).
    Status(u16),
    /// The body was larger than [`super::federation::MAX_BODY`].
    TooLarge,
    /// A 2xx whose body is not a device list.
    NotAList,
    /// A device list, but for another user.
    WrongUser,
    /// Our side failed (the database did not store the list).
    Local,
}

/// Who a failure is charged to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blame {
    /// The server is down, overloaded, or refuses us: back off the server;
    /// none of its users is asked until the wait is over.
    Server,
    /// The server is up but this user's list is unusable: back off the
    /// user alone; the server's other users go on.
    User,
    /// Our own failure: neither is charged; the job tries again shortly.
    Local,
}

/// Who is to blame for `kind` (SPEC §5.2).
///
/// 401 is the server's: it is how a server answers a signature it cannot
/// check, which is the same for every user. 408 and 429 are about load.
/// Informational and redirect statuses are not answers to the request
/// (redirects are not followed), so they count as the server's too.
pub fn blame(kind: FailureKind) -> Blame {
    match kind {
        FailureKind::Unreachable => Blame::Server,
        FailureKind::Status(401 | 408 | 429) => Blame::Server,
        FailureKind::Status(400..=499) => Blame::User,
        FailureKind::Status(_) => Blame::Server,
        FailureKind::TooLarge | FailureKind::NotAList | FailureKind::WrongUser => Blame::User,
        FailureKind::Local => Blame::Local,
    }
}

/// Waits between tries: from `min`, doubling, capped at `max`. The same
/// growth serves a server and a single user.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The first wait (`DLU_RETRY_MIN`).
    pub min: Duration,
    /// The longest wait (`DLU_RETRY_MAX`).
    pub max: Duration,
}

/// How much the spread may add to a wait (10%), so servers that failed
/// together do not come back together.
pub const SPREAD: f64 = 0.1;

impl RetryPolicy {
    /// The floor after the `failures`-th failure in a row (1 for the first):
    /// `min · 2^(failures−1)` capped at `max`, or `asked` (the remote's
    /// `retry_after_ms` / `Retry-After`) if that is longer, never more than
    /// `max` (a server cannot park its users for days).
    pub fn floor(&self, failures: u32, asked: Option<Duration>) -> Duration {
        let max = self.cap();
        let exponential = ExponentialBuilder::default()
            .with_min_delay(self.min)
            .with_max_delay(max)
            .with_factor(2.0)
            .without_max_times()
            .build()
            // Stepping the iterator is linear; past 64 doublings every
            // wait is `max` anyway.
            .nth(failures.saturating_sub(1).min(64) as usize)
            .unwrap_or(max)
            .min(max);
        match asked {
            Some(asked) => exponential.max(asked.min(max)),
            None => exponential,
        }
    }

    /// The wait to use: the floor, lengthened by up to [`SPREAD`] with
    /// `unit` (a random number in 0.0..=1.0), never past `max`.
    pub fn wait(&self, failures: u32, asked: Option<Duration>, unit: f64) -> Duration {
        spread_up(self.floor(failures, asked), SPREAD, unit, self.cap())
    }

    /// `max`, or `min` when set below it.
    fn cap(&self) -> Duration {
        self.max.max(self.min)
    }
}

/// Lengthens `floor` by up to `fraction` (0.0–1.0) using `unit` (0.0–1.0),
/// but not past `cap` (nor below `floor`: a floor is never shortened).
pub fn spread_up(floor: Duration, fraction: f64, unit: f64, cap: Duration) -> Duration {
    let extra = floor.mul_f64(fraction.clamp(0.0, 1.0) * unit.clamp(0.0, 1.0));
    (floor + extra).min(cap.max(floor))
}

/// A random number in 0.0..=1.0 for [`RetryPolicy::wait`].
pub fn random_unit() -> f64 {
    f64::from(getrandom::u32().unwrap_or(0)) / f64::from(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);
    const MAX: Duration = Duration::from_secs(3600);
    const POLICY: RetryPolicy = RetryPolicy { min: MIN, max: MAX };

    #[test]
    fn blame_table() {
        use Blame::{Server, User};
        use FailureKind::*;
        let table = [
            (Unreachable, Server),
            (Status(500), Server),
            (Status(502), Server),
            (Status(503), Server),
            (Status(429), Server),
            (Status(401), Server),
            (Status(408), Server),
            (Status(302), Server),
            (Status(400), User),
            (Status(403), User),
            (Status(404), User),
            (Status(410), User),
            (Status(413), User),
            (TooLarge, User),
            (NotAList, User),
            (WrongUser, User),
            (FailureKind::Local, Blame::Local),
        ];
        for (kind, expected) in table {
            assert_eq!(blame(kind), expected, "{kind:?}");
        }
    }

    #[test]
    fn failures_double_from_min_to_max() {
        let table = [
            (1, 60),
            (2, 120),
            (3, 240),
            (4, 480),
            (5, 960),
            (6, 1920),
            (7, 3600),
            (8, 3600),
            (1000, 3600),
            (u32::MAX, 3600),
        ];
        for (failures, seconds) in table {
            assert_eq!(
                POLICY.floor(failures, None),
                Duration::from_secs(seconds),
                "after {failures} failures"
            );
        }
        // zero is treated as the first failure
        assert_eq!(POLICY.floor(0, None), MIN);
    }

    #[test]
    fn an_asked_wait_is_a_floor() {
        let table = [
            // (failures, asked, expected)
            (1, 300, 300),     // longer than the back-off: honoured
            (1, 5, 60),        // shorter: the back-off still applies
            (4, 300, 480),     // the back-off is already longer
            (1, 90_000, 3600), // capped at max
        ];
        for (failures, asked, expected) in table {
            assert_eq!(
                POLICY.floor(failures, Some(Duration::from_secs(asked))),
                Duration::from_secs(expected),
                "{failures} failures, asked {asked}"
            );
        }
    }

    #[test]
    fn max_below_min_means_min() {
        let policy = RetryPolicy {
            min: Duration::from_secs(10),
            max: Duration::from_secs(1),
        };
        assert_eq!(policy.floor(5, None), Duration::from_secs(10));
        assert_eq!(policy.wait(5, None, 1.0), Duration::from_secs(10));
    }

    #[test]
    fn the_spread_never_shortens_a_floor() {
        let cap = Duration::from_secs(1000);
        let table = [
            // (floor ms, unit, expected ms)
            (1000, 0.0, 1000),
            (1000, 0.5, 1050),
            (1000, 1.0, 1100),
            (1500, 0.0, 1500),
            (12_000, 0.0, 12_000),
            (12_000, 1.0, 13_200),
            (999_000, 1.0, 1_000_000), // stops at the cap
            (1_000_000, 0.7, 1_000_000),
        ];
        for (floor, unit, expected) in table {
            assert_eq!(
                spread_up(Duration::from_millis(floor), SPREAD, unit, cap),
                Duration::from_millis(expected),
                "floor {floor} ms, unit {unit}"
            );
        }
        // Out-of-range randomness cannot shorten it either.
        assert_eq!(
            spread_up(Duration::from_secs(2), SPREAD, -5.0, cap),
            Duration::from_secs(2)
        );
    }

    #[test]
    fn waits_sit_between_the_floor_and_the_cap() {
        let policy = RetryPolicy {
            min: Duration::from_millis(1200),
            max: Duration::from_secs(30),
        };
        for failures in 1..10 {
            for asked in [
                None,
                Some(Duration::from_millis(1500)),
                Some(Duration::from_secs(2)),
            ] {
                for unit in [0.0, 0.3, 0.99, 1.0] {
                    let floor = policy.floor(failures, asked);
                    let wait = policy.wait(failures, asked, unit);
                    assert!(
                        wait >= floor,
                        "{failures} {asked:?} {unit}: {wait:?} < {floor:?}"
                    );
                    assert!(wait >= asked.unwrap_or_default());
                    assert!(wait >= policy.min);
                    assert!(wait <= policy.max);
                }
            }
        }
    }
}
