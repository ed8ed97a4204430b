//! The stream ids we know for a user: what a `prev_id` entry is checked against.

use std::collections::VecDeque;

/// How many recent stream ids are remembered per user. A sender lists in
/// `prev_id` only ids it has not referred to before, so the last few suffice.
pub const KNOWN_IDS_KEPT: usize = 32;

/// The most recent stream ids known for one user, newest first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KnownStreamIds {
    ids: VecDeque<i64>,
}

impl KnownStreamIds {
    /// Reads the stored JSON array; a damaged value counts as "nothing known",
    /// which is safe: it can only cause a fetch.
    pub fn from_json(json: &str) -> Self {
        let ids: Vec<i64> = serde_json::from_str(json).unwrap_or_default();
        KnownStreamIds { ids: ids.into() }
    }

    /// The stored form, a JSON array newest first.
    pub fn to_json(&self) -> String {
        let ids: Vec<i64> = self.ids.iter().copied().collect();
        serde_json::to_string(&ids).unwrap_or_else(|_| "[]".to_owned())
    }

    /// Whether `id` is known.
    pub fn contains(&self, id: i64) -> bool {
        self.ids.contains(&id)
    }

    /// Remembers `id` as the newest known id.
    pub fn remember(&mut self, id: i64) {
        if let Some(pos) = self.ids.iter().position(|&k| k == id) {
            self.ids.remove(pos);
        }
        self.ids.push_front(id);
        self.ids.truncate(KNOWN_IDS_KEPT);
    }

    /// The ids, newest first.
    pub fn iter(&self) -> impl Iterator<Item = i64> + '_ {
        self.ids.iter().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_newest_ids_without_duplicates() {
        let mut known = KnownStreamIds::default();
        for id in 0..40 {
            known.remember(id);
        }
        known.remember(39);
        assert!(known.contains(39) && known.contains(8));
        assert!(!known.contains(7));
        assert_eq!(known.iter().count(), KNOWN_IDS_KEPT);
        let round_trip = KnownStreamIds::from_json(&known.to_json());
        assert_eq!(round_trip, known);
        assert_eq!(
            KnownStreamIds::from_json("garbage"),
            KnownStreamIds::default()
        );
    }
}
