//! The back-off policy for a remote server whose fetch failed (SPEC §5.2), as
//! a pure function: how long its fetch job waits before the next try.
//!
//! Built on `backon`'s exponential builder. The `backoff` crate is
//! unmaintained (RUSTSEC-2025-0012, and its `instant` dependency
//! RUSTSEC-2024-0384); `backon` is its maintained successor and computes
//! delays as a plain iterator, without running a retry loop.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

/// How a fetch failed, as far as waiting is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// Network error, timeout, 5xx, an unusable answer, a refused address.
    Transient,
    /// The server asked us to wait (429 `retry_after_ms`, or `Retry-After`).
    /// None: 429 without saying how long.
    SlowDown(Option<Duration>),
    /// A 4xx other than 429: asking again soon will not help.
    Refused,
}

/// Waits between tries of one server: from `min`, doubling, capped at `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The first wait (`DLU_RETRY_MIN`).
    pub min: Duration,
    /// The longest wait (`DLU_RETRY_MAX`).
    pub max: Duration,
}

impl RetryPolicy {
    /// The wait after the `failures`-th failure in a row (1 for the first).
    ///
    /// - Transient: `min · 2^(failures−1)`, capped at `max`.
    /// - SlowDown: the server's wait if longer than that, never more than
    ///   `max` (a server cannot park its users for days).
    /// - Refused: `max`.
    pub fn delay(&self, failures: u32, failure: Failure) -> Duration {
        let max = self.max.max(self.min);
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
        match failure {
            Failure::Transient | Failure::SlowDown(None) => exponential,
            Failure::SlowDown(Some(asked)) => exponential.max(asked).min(max),
            Failure::Refused => max,
        }
    }
}

/// Spreads a wait by up to ±`fraction` (0.0–1.0) using `unit` (a random
/// number in 0.0..1.0), so servers that failed together do not come back
/// together.
pub fn spread(delay: Duration, fraction: f64, unit: f64) -> Duration {
    let fraction = fraction.clamp(0.0, 1.0);
    let factor = 1.0 - fraction + 2.0 * fraction * unit.clamp(0.0, 1.0);
    delay.mul_f64(factor)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);
    const MAX: Duration = Duration::from_secs(3600);
    const POLICY: RetryPolicy = RetryPolicy { min: MIN, max: MAX };

    #[test]
    fn transient_failures_double_from_min_to_max() {
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
                POLICY.delay(failures, Failure::Transient),
                Duration::from_secs(seconds),
                "after {failures} failures"
            );
        }
        // zero is treated as the first failure
        assert_eq!(POLICY.delay(0, Failure::Transient), MIN);
    }

    #[test]
    fn a_server_asking_to_slow_down_is_not_retried_early() {
        let table = [
            // (failures, asked, expected)
            (1, Some(300), 300),     // longer than the back-off: honoured
            (1, Some(5), 60),        // shorter: the back-off still applies
            (4, Some(300), 480),     // the back-off is already longer
            (1, Some(90_000), 3600), // capped at max
            (2, None, 120),          // 429 without a time: plain back-off
        ];
        for (failures, asked, expected) in table {
            assert_eq!(
                POLICY.delay(failures, Failure::SlowDown(asked.map(Duration::from_secs))),
                Duration::from_secs(expected),
                "{failures} failures, asked {asked:?}"
            );
        }
    }

    #[test]
    fn refusals_wait_the_maximum() {
        assert_eq!(POLICY.delay(1, Failure::Refused), MAX);
        assert_eq!(POLICY.delay(9, Failure::Refused), MAX);
    }

    #[test]
    fn max_below_min_means_min() {
        let policy = RetryPolicy {
            min: Duration::from_secs(10),
            max: Duration::from_secs(1),
        };
        assert_eq!(policy.delay(5, Failure::Transient), Duration::from_secs(10));
    }

    #[test]
    fn spread_stays_within_the_fraction() {
        let d = Duration::from_secs(100);
        assert_eq!(spread(d, 0.1, 0.0), Duration::from_secs(90));
        assert_eq!(spread(d, 0.1, 0.5), Duration::from_secs(100));
        assert_eq!(spread(d, 0.1, 1.0), Duration::from_secs(110));
        assert_eq!(spread(d, 0.0, 0.9), d);
    }
}
