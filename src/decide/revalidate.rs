//! How many revalidations may start now (SPEC §5.7.1), as a pure rule.
//!
//! Revalidations run at about `tracked users / DLU_REVALIDATE_AFTER` per
//! second whatever the ages of the lists: a token bucket filled at that
//! rate and holding at most one second's worth. Lists that all fall due
//! together (a large import, a migration that found no fetch times, a
//! deployment whose users were all fetched in its first hour) are
//! therefore worked through at the same even rate, and a restart, an
//! outage or a pause of the pacer never saves up a burst: the bucket
//! starts empty and what it could not spend is dropped.

use std::time::Duration;

/// The bucket never holds more than this long's worth of revalidations.
pub const MOST_SAVED: Duration = Duration::from_secs(1);

/// Revalidations per second for `tracked` users and a period of `after`
/// (0 when revalidation is off: a zero period).
pub fn rate_per_second(tracked: u64, after: Duration) -> f64 {
    if after.is_zero() {
        return 0.0;
    }
    tracked as f64 / after.as_secs_f64()
}

/// The shortest wait between two counts of the tracked users while some
/// were found.
pub const RECOUNT: Duration = Duration::from_secs(10);
/// The wait while none were found (a new deployment, an empty database).
pub const RECOUNT_EMPTY: Duration = Duration::from_secs(1);
/// A count may take at most this share of the time between counts.
const RECOUNT_SHARE: u32 = 100;

/// When the tracked users are counted again, after a count that found
/// `tracked` and took `took`: the count reads every tracked user (on
/// PostgreSQL a whole-table scan, about a tenth of a second at a million),
/// so the wait grows with what it costs and counting never takes more than
/// a hundredth of the database's time, however many users there are.
pub fn recount_after(tracked: u64, took: Duration) -> Duration {
    if tracked == 0 {
        return RECOUNT_EMPTY;
    }
    RECOUNT.max(took.saturating_mul(RECOUNT_SHARE))
}

/// The token bucket of revalidations; starts empty.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pacer {
    tokens: f64,
}

impl Pacer {
    /// After `elapsed` at `rate` per second: how many revalidations may
    /// start now. The bucket keeps the fraction left over, up to
    /// [`MOST_SAVED`] worth (and at least one, so a rate below one per
    /// second still starts one now and then).
    pub fn take(&mut self, rate: f64, elapsed: Duration) -> u64 {
        if rate.is_nan() || rate <= 0.0 {
            self.tokens = 0.0;
            return 0;
        }
        let most = (rate * MOST_SAVED.as_secs_f64()).max(1.0);
        self.tokens = (self.tokens + rate * elapsed.as_secs_f64()).min(most);
        let whole = self.tokens.floor();
        self.tokens -= whole;
        whole as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn counting_takes_at_most_a_hundredth() {
        for (tracked, took, after) in [
            (0, ms(5), RECOUNT_EMPTY),
            (0, ms(500), RECOUNT_EMPTY),
            (10_000, ms(2), RECOUNT),
            (1_000_000, ms(100), RECOUNT),
            (1_000_000, ms(135), ms(13_500)),
            (10_000_000, ms(1_400), ms(140_000)),
        ] {
            assert_eq!(recount_after(tracked, took), after, "{tracked} in {took:?}");
        }
    }

    #[test]
    fn rate_is_tracked_over_the_period() {
        for (tracked, after, rate) in [
            (2_000, Duration::from_secs(20), 100.0),
            (100_000, Duration::from_secs(500), 200.0),
            (604_800, Duration::from_secs(7 * 86_400), 1.0),
            (0, Duration::from_secs(20), 0.0),
            (1_000, Duration::ZERO, 0.0),
        ] {
            assert_eq!(
                rate_per_second(tracked, after),
                rate,
                "{tracked} / {after:?}"
            );
        }
    }

    #[test]
    fn steady_ticks_give_the_rate() {
        let mut pacer = Pacer::default();
        let taken: u64 = (0..100).map(|_| pacer.take(100.0, ms(100))).sum();
        // Ten seconds at 100 per second.
        assert_eq!(taken, 1_000);
    }

    #[test]
    fn a_long_gap_saves_at_most_one_second() {
        for (rate, gap, most) in [
            (100.0, Duration::from_secs(30), 100),
            (200.0, Duration::from_secs(3_600), 200),
            (0.5, Duration::from_secs(600), 1),
        ] {
            let mut pacer = Pacer::default();
            assert_eq!(pacer.take(rate, gap), most, "{rate}/s after {gap:?}");
        }
    }

    #[test]
    fn a_slow_rate_accumulates_to_one() {
        // 10,080 users over 7 days: one per minute.
        let mut pacer = Pacer::default();
        let rate = 1.0 / 60.0;
        let taken: Vec<u64> = (0..120)
            .map(|_| pacer.take(rate, Duration::from_secs(1)))
            .collect();
        assert_eq!(taken.iter().sum::<u64>(), 2);
        assert_eq!(taken.iter().position(|&n| n == 1), Some(59));
    }

    #[test]
    fn starts_empty_and_off_is_nothing() {
        let mut pacer = Pacer::default();
        assert_eq!(pacer.take(100.0, Duration::ZERO), 0);
        assert_eq!(pacer.take(0.0, Duration::from_secs(10)), 0);
        assert_eq!(pacer.take(f64::NAN, Duration::from_secs(10)), 0);
    }

    #[test]
    fn no_window_of_one_second_gets_more_than_twice_the_rate() {
        // Ticks of uneven length, as a loaded machine gives them.
        let mut pacer = Pacer::default();
        let mut starts: Vec<(u64, u64)> = Vec::new();
        let mut now = 0;
        for i in 0..2_000_u64 {
            let step = [10, 250, 40, 1_500, 90, 5][(i % 6) as usize];
            now += step;
            starts.push((now, pacer.take(100.0, ms(step))));
        }
        for &(from, _) in &starts {
            let in_window: u64 = starts
                .iter()
                .filter(|(at, _)| *at >= from && *at < from + 1_000)
                .map(|(_, n)| n)
                .sum();
            assert!(in_window <= 200, "{in_window} in the second from {from} ms");
        }
    }
}
