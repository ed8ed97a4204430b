//! Who is tracked: the one membership switch (SPEC §5.5, §5.6), built once
//! from the settings and handed to every part that reads room input or
//! decides who shares a room.

use ruma::OwnedServerName;

/// Who is tracked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Tracking {
    /// `membership = off`: every remote user whose updates arrive is
    /// tracked; room input is acked and ignored.
    #[default]
    Everyone,
    /// `membership = on`: only remote users who share a room with our server.
    SharedRooms(RoomRules),
}

/// How room input is read when rooms decide who is tracked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoomRules {
    /// Our server: its joined identities make a room ours.
    pub own_server: OwnedServerName,
    /// `msc4430 = on`: MSC4430 member keys are room identities (SPEC §5.6).
    pub member_keys: bool,
}

impl Tracking {
    /// The room rules, when rooms decide who is tracked.
    pub fn rooms(&self) -> Option<&RoomRules> {
        match self {
            Tracking::Everyone => None,
            Tracking::SharedRooms(rules) => Some(rules),
        }
    }

    /// Whether rooms decide who is tracked.
    pub fn by_rooms(&self) -> bool {
        self.rooms().is_some()
    }

    /// Whether member keys are read as identities (only with rooms on).
    pub fn member_keys(&self) -> bool {
        self.rooms().is_some_and(|rules| rules.member_keys)
    }
}
