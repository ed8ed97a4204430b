//! What a batch plans: the stored state it is planned over ([`Snapshot`],
//! [`RoomSnapshot`]), what it writes and emits ([`Plan`], [`RoomWrites`]),
//! and the one way a plan marks a user stale. The batch rules
//! ([`super::batch`]) and the room rules ([`super::rooms`]) both build on
//! these types; neither imports the other's.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use ruma::{OwnedDeviceId, OwnedRoomId, OwnedServerName, OwnedUserId, RoomId, UserId};

use super::device::DeviceRow;
use super::known_ids::KnownStreamIds;
use super::membership::{Link, Member};
use crate::input::cross_signing::KeyUsage;
use crate::input::identity::{Identity, MemberKey};
use crate::key_change::KeyChange;

/// Stream state of one user.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UserState {
    /// Known stream ids.
    pub known: KnownStreamIds,
    /// Highest stream id seen.
    pub max_stream_id: i64,
    /// Stream position of the last fetched list (0: never fetched).
    pub fetched_stream_id: i64,
}

/// A user's stale mark.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StaleMark {
    /// Stream ids of the updates that made the user stale.
    pub trigger_ids: Vec<i64>,
    /// When the user was first marked (Unix ms).
    pub marked_at_ms: i64,
}

/// The stored state of the users a batch touches.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Stream state per user (absent: never seen).
    pub users: HashMap<OwnedUserId, UserState>,
    /// Stored devices, tombstones included.
    pub devices: HashMap<(OwnedUserId, OwnedDeviceId), DeviceRow>,
    /// Current stale marks.
    pub stale: HashMap<OwnedUserId, StaleMark>,
    /// Stored cross-signing keys.
    pub cross_signing: HashMap<(OwnedUserId, KeyUsage), String>,
    /// With membership on (SPEC §5.5): the room state, and only users that
    /// share a room with us are tracked. None: every remote user is.
    pub rooms: Option<RoomSnapshot>,
}

/// What happened to one message (for logs and metrics).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Applied and emitted a change.
    Applied,
    /// Applied, but nothing visible changed.
    Unchanged,
    /// Older than the stored device: not applied.
    Outdated,
    /// The user was marked stale.
    Stale,
    /// A resync was requested: the user was marked stale.
    ResyncRequested,
    /// Cross-signing keys changed.
    KeysChanged,
    /// Cross-signing keys were identical.
    KeysUnchanged,
    /// About a user that shares no room with us: dropped (SPEC §5.5.6).
    Untracked,
    /// A membership or link change was applied.
    MembershipApplied,
    /// A membership or link change not newer than the stored one (SPEC
    /// §5.5.2): ignored.
    Replayed,
    /// A link naming another user than the key's first (SPEC §5.6.2): not
    /// applied; the message is dead-lettered.
    LinkConflict,
    /// Room input while membership is off: ignored.
    MembershipOff,
}

impl Outcome {
    /// A short label for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Applied => "applied",
            Outcome::Unchanged => "unchanged",
            Outcome::Outdated => "outdated",
            Outcome::Stale => "stale",
            Outcome::ResyncRequested => "resync_requested",
            Outcome::KeysChanged => "keys_changed",
            Outcome::KeysUnchanged => "keys_unchanged",
            Outcome::Untracked => "untracked",
            Outcome::MembershipApplied => "applied",
            Outcome::Replayed => "replayed",
            Outcome::LinkConflict => "link_conflict",
            Outcome::MembershipOff => "ignored",
        }
    }

    /// Whether it is the outcome of room input (counted apart from updates).
    pub fn is_room_outcome(self) -> bool {
        match self {
            Outcome::MembershipApplied
            | Outcome::Replayed
            | Outcome::LinkConflict
            | Outcome::MembershipOff => true,
            Outcome::Applied
            | Outcome::Unchanged
            | Outcome::Outdated
            | Outcome::Stale
            | Outcome::ResyncRequested
            | Outcome::KeysChanged
            | Outcome::KeysUnchanged
            | Outcome::Untracked => false,
        }
    }
}

/// What a batch writes and emits. Only dirty rows are listed.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    /// User stream state to upsert.
    pub users: BTreeMap<OwnedUserId, UserState>,
    /// Device rows to upsert.
    pub devices: BTreeMap<(OwnedUserId, OwnedDeviceId), DeviceRow>,
    /// Stale marks to upsert (merged with what was stored).
    pub stale: BTreeMap<OwnedUserId, StaleMark>,
    /// Cross-signing keys to upsert.
    pub cross_signing: BTreeMap<(OwnedUserId, KeyUsage), String>,
    /// Key-change events, in order.
    pub events: Vec<KeyChange>,
    /// One outcome per message, in input order.
    pub outcomes: Vec<Outcome>,
    /// Servers that need a fetch job (they have a user marked stale here).
    pub fetch_servers: BTreeSet<OwnedServerName>,
    /// Room rows, shared-room counts and users to untrack.
    pub rooms: RoomWrites,
}

/// A room's own stored state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RoomRow {
    /// Joined local identities: the room is ours while above zero.
    pub local_joined: u32,
    /// A sweep is pending (the room became ours or stopped being ours).
    pub sweep: bool,
}

/// One user in one room.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RoomUser {
    /// The user's joined identities in the room.
    pub joined: u32,
    /// Counted in the user's shared rooms.
    pub shares: bool,
}

/// The stored room state a batch needs, and the rule it runs under.
#[derive(Clone, Debug)]
pub struct RoomSnapshot {
    /// Our server: its users are local identities.
    pub own: OwnedServerName,
    /// Rooms the batch names.
    pub rooms: HashMap<OwnedRoomId, RoomRow>,
    /// Stored memberships of the identities the batch names.
    pub members: HashMap<(OwnedRoomId, Identity), Member>,
    /// Stored links of the keys the batch names.
    pub links: HashMap<(OwnedRoomId, MemberKey), Link>,
    /// (room, user) rows of the users the batch may touch.
    pub room_users: HashMap<(OwnedRoomId, OwnedUserId), RoomUser>,
    /// Stored shared-room counts of those users (absent: zero): the pairs
    /// marked as sharing, rooms we left and not yet swept included. Kept
    /// for the sweeps; it decides nothing.
    pub shared: HashMap<OwnedUserId, u32>,
    /// The rooms those users share with us now (absent: zero): pairs marked
    /// as sharing in rooms that are ours. This decides who is tracked.
    pub shared_now: HashMap<OwnedUserId, u32>,
}

impl RoomSnapshot {
    /// An empty snapshot for our server `own`.
    pub fn new(own: OwnedServerName) -> RoomSnapshot {
        RoomSnapshot {
            own,
            rooms: HashMap::new(),
            members: HashMap::new(),
            links: HashMap::new(),
            room_users: HashMap::new(),
            shared: HashMap::new(),
            shared_now: HashMap::new(),
        }
    }

    /// Whether `user` shares a room with us now.
    pub fn is_shared(&self, user: &UserId) -> bool {
        self.shared_now.get(user).is_some_and(|&n| n > 0)
    }

    /// Whether `room` is ours (as far as this snapshot knows it).
    pub fn is_ours(&self, room: &RoomId) -> bool {
        self.rooms.get(room).is_some_and(|r| r.local_joined > 0)
    }
}

/// The room rows a batch writes. Only dirty rows are listed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RoomWrites {
    /// Room rows to upsert.
    pub rooms: BTreeMap<OwnedRoomId, RoomRow>,
    /// Membership rows to upsert.
    pub members: BTreeMap<(OwnedRoomId, Identity), Member>,
    /// Link rows to upsert.
    pub links: BTreeMap<(OwnedRoomId, MemberKey), Link>,
    /// (room, user) rows to upsert.
    pub room_users: BTreeMap<(OwnedRoomId, OwnedUserId), RoomUser>,
    /// Shared-room counts to write (0: delete the row).
    pub shared: BTreeMap<OwnedUserId, u32>,
    /// Users that stopped sharing every room: everything stored about them
    /// goes (SPEC §5.5.4). Written before any other row of the plan.
    pub untrack: BTreeSet<OwnedUserId>,
}

impl RoomWrites {
    /// Whether nothing is written.
    pub fn is_empty(&self) -> bool {
        *self == RoomWrites::default()
    }
}

/// Marks `user` stale (adding `trigger` to its mark) and asks for a fetch
/// job for its server.
pub(super) fn mark_stale(
    snapshot: &mut Snapshot,
    plan: &mut Plan,
    user: &UserId,
    trigger: Option<i64>,
    now_ms: i64,
) {
    record_stale(snapshot, plan, user, trigger, now_ms);
    plan.fetch_servers.insert(user.server_name().to_owned());
}

/// Writes `user`'s stale mark (adding `trigger` to it), without asking for
/// a fetch.
pub(super) fn record_stale(
    snapshot: &mut Snapshot,
    plan: &mut Plan,
    user: &UserId,
    trigger: Option<i64>,
    now_ms: i64,
) {
    let mark = snapshot
        .stale
        .entry(user.to_owned())
        .or_insert_with(|| StaleMark {
            trigger_ids: Vec::new(),
            marked_at_ms: now_ms,
        });
    if let Some(id) = trigger
        && !mark.trigger_ids.contains(&id)
    {
        mark.trigger_ids.push(id);
    }
    plan.stale.insert(user.to_owned(), mark.clone());
}
