//! The prev_id rules of SPEC §5.1, points 3 to 6, for one update.

use super::known_ids::KnownStreamIds;

/// What to do with one device-list update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpdateDecision {
    /// Write the device (or its deletion). `also_stale`: a deletion whose
    /// prev_id is unknown is applied and the user is marked stale too (§5.1.5).
    Apply {
        /// Mark the user stale as well.
        also_stale: bool,
    },
    /// The stored device is as new or newer: never overwrite it (§5.1.4).
    Outdated {
        /// Mark the user stale as well (a deletion with unknown prev_id).
        also_stale: bool,
    },
    /// An update is missing: mark the user stale and fetch the list (§5.1.6).
    Stale,
}

/// Whether every `prev_id` entry is known. An empty `prev_id` is never known:
/// Synapse senders rely on "empty prev_id means resync" (synapse#7173).
pub fn prev_ids_known(prev_ids: &[i64], known: &KnownStreamIds) -> bool {
    !prev_ids.is_empty() && prev_ids.iter().all(|&p| known.contains(p))
}

/// Decides one update.
///
/// * `stored_stream_id`: the stream id of the stored row for this device
///   (a tombstone counts), if any.
/// * `fetched_stream_id`: the stream position of the user's last fetched
///   list (0: never fetched). That list was the state of *every* device as
///   of that position, listed or not, so an update at or below it is
///   outdated whatever its device (§5.1.4 read for the whole list); it does
///   not make the user stale either, as the fetch already covered it.
pub fn decide_update(
    prev_ids: &[i64],
    deleted: bool,
    stream_id: i64,
    known: &KnownStreamIds,
    stored_stream_id: Option<i64>,
    fetched_stream_id: i64,
) -> UpdateDecision {
    if stream_id <= fetched_stream_id {
        return UpdateDecision::Outdated { also_stale: false };
    }
    let prev_known = prev_ids_known(prev_ids, known);
    if !prev_known && !deleted {
        return UpdateDecision::Stale;
    }
    let also_stale = !prev_known;
    match stored_stream_id {
        Some(stored) if stream_id <= stored => UpdateDecision::Outdated { also_stale },
        _ => UpdateDecision::Apply { also_stale },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use UpdateDecision::*;

    fn known(ids: &[i64]) -> KnownStreamIds {
        let mut k = KnownStreamIds::default();
        ids.iter().for_each(|&id| k.remember(id));
        k
    }

    #[test]
    fn decision_table() {
        // (prev_ids, deleted, stream_id, known, stored stream id) -> decision
        type Row = (
            &'static [i64],
            bool,
            i64,
            &'static [i64],
            Option<i64>,
            UpdateDecision,
        );
        let table: &[Row] = &[
            // known prev_id: apply
            (&[5], false, 6, &[5], None, Apply { also_stale: false }),
            (
                &[4, 5],
                false,
                6,
                &[4, 5],
                Some(4),
                Apply { also_stale: false },
            ),
            // one unknown entry is enough to be stale
            (&[4, 5], false, 6, &[5], None, Stale),
            // unknown prev_id: stale
            (&[5], false, 6, &[], None, Stale),
            // empty prev_id: always stale, even for a known user
            (&[], false, 6, &[5], Some(5), Stale),
            // deletion with unknown or empty prev_id: applied, and stale
            (&[5], true, 6, &[], Some(3), Apply { also_stale: true }),
            (&[], true, 6, &[], None, Apply { also_stale: true }),
            // deletion with known prev_id: applied only
            (&[5], true, 6, &[5], Some(5), Apply { also_stale: false }),
            // stored device as new or newer: never overwritten
            (
                &[5],
                false,
                6,
                &[5],
                Some(6),
                Outdated { also_stale: false },
            ),
            (
                &[5],
                false,
                6,
                &[5],
                Some(9),
                Outdated { also_stale: false },
            ),
            (&[5], true, 6, &[], Some(7), Outdated { also_stale: true }),
        ];
        for (prev, deleted, stream, k, stored, want) in table {
            assert_eq!(
                decide_update(prev, *deleted, *stream, &known(k), *stored, 0),
                *want,
                "prev={prev:?} deleted={deleted} stream={stream} known={k:?} stored={stored:?}"
            );
        }
    }

    #[test]
    fn an_update_covered_by_the_last_fetch_is_outdated_for_every_device() {
        // The fetched list at stream 7 did not have this device: an older
        // update of it (a redelivery) must not bring it back, known prev_id
        // or not, and must not cause another fetch.
        for (prev, deleted, stream) in [
            (&[5][..], false, 6),
            (&[5], false, 7),
            (&[1], false, 6),
            (&[], true, 6),
        ] {
            assert_eq!(
                decide_update(prev, deleted, stream, &known(&[5, 7]), None, 7),
                Outdated { also_stale: false },
                "prev={prev:?} deleted={deleted} stream={stream}"
            );
        }
        // newer than the fetch: the usual rules
        assert_eq!(
            decide_update(&[7], false, 8, &known(&[5, 7]), None, 7),
            Apply { also_stale: false }
        );
    }
}
