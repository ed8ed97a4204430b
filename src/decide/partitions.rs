//! Which replica ingests which input partition (SPEC §4.5): a pure function
//! of the partition count and the live replicas, so every replica that sees
//! the same replicas computes the same deal without talking to the others.
//!
//! Rendezvous hashing (each partition goes to the replica that ranks it
//! highest) moves few partitions when a replica comes or goes, but its
//! balance is only statistical: 8 partitions over 3 replicas can fall 5/2/1.
//! So each replica takes at most its share: `P / N` partitions, and the
//! first `P mod N` replicas to fill up one more. Partitions are dealt in
//! order, each to the highest-ranked replica with room left, which keeps
//! every replica within one partition of every other and still leaves most
//! partitions where they were when the set of replicas changes.

use std::collections::BTreeMap;

use crate::input::partition::partition_of_key;

/// The partitions each replica of `replicas` ingests, out of `partitions`.
/// Duplicate ids count once; their order does not matter. Every partition
/// has exactly one replica (none when `replicas` is empty).
pub fn deal(partitions: u16, replicas: &[String]) -> BTreeMap<String, Vec<u16>> {
    let mut ids: Vec<&str> = replicas.iter().map(String::as_str).collect();
    ids.sort_unstable();
    ids.dedup();
    let mut dealt: BTreeMap<String, Vec<u16>> = ids
        .iter()
        .map(|id| ((*id).to_owned(), Vec::new()))
        .collect();
    if ids.is_empty() {
        return dealt;
    }
    let n = ids.len();
    let floor = usize::from(partitions) / n;
    // How many replicas may hold one more than `floor`.
    let mut larger_left = usize::from(partitions) % n;
    for partition in 0..partitions {
        let mut ranked: Vec<(u16, &str)> = ids
            .iter()
            .map(|id| {
                (
                    partition_of_key(&format!("{partition}/{id}"), u16::MAX),
                    *id,
                )
            })
            .collect();
        // Highest weight first; ties by id, so the order is total.
        ranked.sort_unstable_by(|a, b| b.cmp(a));
        let chosen = ranked.into_iter().find_map(|(_, id)| {
            let held = dealt.get(id).map_or(0, Vec::len);
            if held < floor {
                Some(id)
            } else if held == floor && larger_left > 0 {
                larger_left -= 1;
                Some(id)
            } else {
                None
            }
        });
        // The capacities add up to `partitions`, so one always has room.
        if let Some(id) = chosen
            && let Some(held) = dealt.get_mut(id)
        {
            held.push(partition);
        }
    }
    dealt
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("replica-{i}")).collect()
    }

    fn counts(dealt: &BTreeMap<String, Vec<u16>>) -> Vec<usize> {
        let mut counts: Vec<usize> = dealt.values().map(Vec::len).collect();
        counts.sort_unstable();
        counts
    }

    #[test]
    fn eight_over_three_is_three_three_two() {
        assert_eq!(counts(&deal(8, &ids(3))), vec![2, 3, 3]);
        assert_eq!(counts(&deal(8, &ids(2))), vec![4, 4]);
        assert_eq!(counts(&deal(1, &ids(3))), vec![0, 0, 1]);
        assert_eq!(counts(&deal(8, &ids(1))), vec![8]);
        assert!(deal(8, &[]).is_empty());
    }

    #[test]
    fn a_replica_joining_moves_few_partitions() {
        let before = deal(8, &ids(2));
        let after = deal(8, &ids(3));
        let moved = (0..8u16)
            .filter(|p| {
                let owner = |dealt: &BTreeMap<String, Vec<u16>>| {
                    dealt
                        .iter()
                        .find(|(_, ps)| ps.contains(p))
                        .map(|(id, _)| id.clone())
                };
                owner(&before) != owner(&after)
            })
            .count();
        // The newcomer takes its two or three; a plain `p mod N` deal would
        // move five of the eight here.
        assert!(moved <= 4, "{moved} partitions moved");
    }

    proptest! {
        #[test]
        fn every_partition_once_and_balanced_within_one(
            partitions in 1u16..=256,
            names in proptest::collection::vec("[a-z0-9-]{1,12}", 1..12),
        ) {
            let dealt = deal(partitions, &names);
            let mut all: Vec<u16> = dealt.values().flatten().copied().collect();
            all.sort_unstable();
            prop_assert_eq!(all, (0..partitions).collect::<Vec<_>>());
            let counts = counts(&dealt);
            prop_assert!(counts[counts.len() - 1] - counts[0] <= 1, "{:?}", counts);
        }

        #[test]
        fn the_order_replicas_are_seen_in_does_not_matter(
            names in proptest::collection::vec("[a-z0-9-]{1,12}", 1..8),
        ) {
            let mut reversed = names.clone();
            reversed.reverse();
            prop_assert_eq!(deal(16, &names), deal(16, &reversed));
        }
    }
}
