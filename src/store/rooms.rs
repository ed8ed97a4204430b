//! Room state (SPEC §5.5, §5.6): loading what a batch's room input needs,
//! writing [`RoomWrites`] (untracking included), and the room sweeps.

use std::collections::BTreeSet;

use entity::{member_key_link, room, room_member, room_user, shared_user};
use ruma::{OwnedRoomId, OwnedServerName, OwnedUserId, RoomId};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DbBackend, DbErr, EntityTrait, QueryFilter, QueryOrder,
    QuerySelect,
};

use super::one_of::{one_of, one_of_each};
use super::{Store, lock_users, write};
use crate::decide::Plan;
use crate::decide::membership::{Link, Member};
use crate::decide::rooms::plan_sweep;
use crate::decide::{RoomRow, RoomSnapshot, RoomUser, RoomWrites};
use crate::input::InputMessage;
use crate::input::identity::{Identity, MemberKey};
use crate::input::membership::Membership;

/// Remote (room, user) pairs re-decided per sweep transaction: small enough
/// that other input waits well under a second for a chunk.
pub const SWEEP_CHUNK: u64 = 1000;

/// Loads the rooms, memberships and links `messages` name. Returns the
/// snapshot without users yet, and the users whose rows it needs: the
/// users the messages name and the users stored links name.
pub(super) async fn load_rooms<C: ConnectionTrait>(
    db: &C,
    own: &OwnedServerName,
    messages: &[InputMessage],
) -> Result<(RoomSnapshot, BTreeSet<OwnedUserId>), DbErr> {
    let mut snapshot = RoomSnapshot::new(own.clone());
    let mut users: BTreeSet<OwnedUserId> = messages
        .iter()
        .filter_map(|m| m.user_id().map(ToOwned::to_owned))
        .collect();
    let (rooms, identities) = named(messages);
    if rooms.is_empty() {
        return Ok((snapshot, users));
    }
    let backend = db.get_database_backend();
    for these in one_of(backend, room::Column::RoomId, rooms.iter().copied()) {
        for row in room::Entity::find().filter(these).all(db).await? {
            if let Ok(id) = OwnedRoomId::try_from(row.room_id) {
                snapshot
                    .rooms
                    .insert(id, room_row(row.local_joined, row.sweep));
            }
        }
    }
    load_members(db, &rooms, &identities, &mut snapshot).await?;
    for row in stored_links(db, &rooms, &identities).await? {
        let (Ok(room), Ok(key)) = (
            OwnedRoomId::try_from(row.room_id),
            MemberKey::parse(&row.member_key),
        ) else {
            continue;
        };
        let user = row.user_id.and_then(|u| OwnedUserId::try_from(u).ok());
        users.extend(user.clone());
        let link = Link {
            user,
            erased: row.erased,
            verified: row.verified,
            stream_ordering: row.stream_ordering,
        };
        snapshot.links.insert((room, key), link);
    }
    let pairs = one_of_each(
        backend,
        (room_user::Column::RoomId, rooms.iter().copied()),
        (room_user::Column::UserId, users.iter().map(|u| u.as_str())),
    );
    for these in pairs {
        for row in room_user::Entity::find().filter(these).all(db).await? {
            insert_pair(&mut snapshot, row);
        }
    }
    Ok((snapshot, users))
}

/// Loads the stored memberships of `identities` in `rooms` into `snapshot`.
async fn load_members<C: ConnectionTrait>(
    db: &C,
    rooms: &[&str],
    identities: &[&str],
    snapshot: &mut RoomSnapshot,
) -> Result<(), DbErr> {
    let backend = db.get_database_backend();
    let members = one_of_each(
        backend,
        (room_member::Column::RoomId, rooms.iter().copied()),
        (room_member::Column::Identity, identities.iter().copied()),
    );
    for these in members {
        for row in room_member::Entity::find().filter(these).all(db).await? {
            let (Ok(room), Ok(identity), Some(membership)) = (
                OwnedRoomId::try_from(row.room_id),
                Identity::parse(&row.identity, true),
                Membership::parse(&row.membership),
            ) else {
                continue;
            };
            let member = Member {
                membership,
                stream_ordering: row.stream_ordering,
            };
            snapshot.members.insert((room, identity), member);
        }
    }
    Ok(())
}

/// The rooms and the identities (user ids or member keys) `messages` name,
/// sorted, each once.
fn named(messages: &[InputMessage]) -> (Vec<&str>, Vec<&str>) {
    let mut rooms = BTreeSet::new();
    let mut identities = BTreeSet::new();
    for message in messages {
        match message {
            InputMessage::Membership(change) => {
                rooms.insert(change.room_id.as_str());
                identities.insert(change.identity.as_str());
            }
            InputMessage::MemberKey(link) => {
                rooms.insert(link.room_id.as_str());
                identities.insert(link.member_key.as_str());
            }
            InputMessage::Update(_) | InputMessage::SigningKey(_) | InputMessage::Resync(_) => {}
        }
    }
    (
        rooms.into_iter().collect(),
        identities.into_iter().collect(),
    )
}

/// The stored links of `identities` (only keys have any) in `rooms`.
async fn stored_links<C: ConnectionTrait>(
    db: &C,
    rooms: &[&str],
    identities: &[&str],
) -> Result<Vec<member_key_link::Model>, DbErr> {
    let backend = db.get_database_backend();
    let mut links = Vec::new();
    let pairs = one_of_each(
        backend,
        (member_key_link::Column::RoomId, rooms.iter().copied()),
        (
            member_key_link::Column::MemberKey,
            identities.iter().copied(),
        ),
    );
    for these in pairs {
        links.extend(
            member_key_link::Entity::find()
                .filter(these)
                .all(db)
                .await?,
        );
    }
    Ok(links)
}

/// The users that stored links of the keys `messages` name stand for. A
/// batch reads them before it takes any lock, so that it can lock them with
/// the users and rooms it names in one sorted round (`docs/design.md`, "One
/// lock order").
pub(super) async fn linked_users<C: ConnectionTrait>(
    db: &C,
    messages: &[InputMessage],
) -> Result<BTreeSet<OwnedUserId>, DbErr> {
    let (rooms, identities) = named(messages);
    Ok(stored_links(db, &rooms, &identities)
        .await?
        .into_iter()
        .filter_map(|row| row.user_id.and_then(|u| OwnedUserId::try_from(u).ok()))
        .collect())
}

/// Loads the shared-room counts of `users` into `snapshot`: the stored
/// ones (the sweeps' bookkeeping) and the rooms shared now
/// ([`super::sharing`]), which decide.
pub(super) async fn load_shared<C: ConnectionTrait>(
    db: &C,
    snapshot: &mut RoomSnapshot,
    users: &[&str],
) -> Result<(), DbErr> {
    for (user, count) in shared_counts(db, users, false).await? {
        snapshot.shared.insert(user, count);
    }
    for (user, count) in super::sharing::rooms_shared_now(db, users).await? {
        snapshot.shared_now.insert(user, count);
    }
    Ok(())
}

/// The shared-room counts of `users` (absent: zero); `lock`: on PostgreSQL
/// take the rows' locks for the rest of the transaction.
pub(super) async fn shared_counts<C: ConnectionTrait>(
    db: &C,
    users: &[&str],
    lock: bool,
) -> Result<Vec<(OwnedUserId, u32)>, DbErr> {
    let mut counts = Vec::new();
    let backend = db.get_database_backend();
    for these in one_of(backend, shared_user::Column::UserId, users.iter().copied()) {
        let mut query = shared_user::Entity::find().filter(these);
        if lock && backend == DbBackend::Postgres {
            query = query.lock_exclusive();
        }
        for row in query.all(db).await? {
            if let Ok(user) = OwnedUserId::try_from(row.user_id) {
                counts.push((user, u32::try_from(row.shared_rooms).unwrap_or(0)));
            }
        }
    }
    Ok(counts)
}

fn room_row(local_joined: i32, sweep: bool) -> RoomRow {
    RoomRow {
        local_joined: u32::try_from(local_joined).unwrap_or(0),
        sweep,
    }
}

fn insert_pair(snapshot: &mut RoomSnapshot, row: room_user::Model) {
    if let (Ok(room), Ok(user)) = (
        OwnedRoomId::try_from(row.room_id),
        OwnedUserId::try_from(row.user_id),
    ) {
        let pair = RoomUser {
            joined: u32::try_from(row.joined).unwrap_or(0),
            shares: row.shares,
        };
        snapshot.room_users.insert((room, user), pair);
    }
}

/// What one sweep transaction did.
#[derive(Debug)]
pub struct SweepChunk {
    /// The plan written (untracked users, stale marks, fetch servers).
    pub plan: Plan,
    /// The room needs no more chunks.
    pub done: bool,
}

impl Store {
    /// Remote users sharing a room with us.
    pub async fn tracked_user_count(&self) -> Result<u64, DbErr> {
        use sea_orm::PaginatorTrait;
        shared_user::Entity::find().count(&self.db).await
    }

    /// How many rooms each of `users` shares with us now (absent: none;
    /// see `store/sharing.rs`).
    pub async fn shared_rooms(
        &self,
        users: &[&str],
    ) -> Result<std::collections::BTreeMap<OwnedUserId, u32>, DbErr> {
        Ok(super::sharing::rooms_shared_now(&self.db, users)
            .await?
            .into_iter()
            .collect())
    }

    /// Rooms with a pending sweep (our server joined or left them).
    pub async fn rooms_to_sweep(&self) -> Result<Vec<OwnedRoomId>, DbErr> {
        Ok(room::Entity::find()
            .select_only()
            .column(room::Column::RoomId)
            .filter(room::Column::Sweep.eq(true))
            .into_tuple::<String>()
            .all(&self.db)
            .await?
            .into_iter()
            .filter_map(|id| OwnedRoomId::try_from(id).ok())
            .collect())
    }

    /// Re-decides up to [`SWEEP_CHUNK`] remote pairs of `room` whose
    /// counted state is wrong, in one transaction under the room's and the
    /// users' locks. Ends the sweep when none is left.
    pub async fn sweep_room(&self, room_id: &RoomId, now_ms: i64) -> Result<SweepChunk, DbErr> {
        let Some(own) = self.rooms_own_server().cloned() else {
            return Ok(SweepChunk {
                plan: Plan::default(),
                done: true,
            });
        };
        // Candidates first, outside the locks; re-read under them.
        let ours = |row: Option<&room::Model>| row.is_some_and(|r| r.local_joined > 0);
        let before = room::Entity::find_by_id(room_id.as_str().to_owned())
            .one(&self.db)
            .await?;
        let candidates: Vec<String> = wrong_pairs(&self.db, room_id, ours(before.as_ref()))
            .await?
            .into_iter()
            .map(|pair| pair.user_id)
            .collect();
        let txn = self.begin_write().await?;
        let mut keys: Vec<&str> = candidates.iter().map(String::as_str).collect();
        keys.push(room_id.as_str());
        keys.sort_unstable();
        lock_users(&txn, &keys).await?;
        let Some(row) = room::Entity::find_by_id(room_id.as_str().to_owned())
            .one(&txn)
            .await?
        else {
            txn.commit().await?;
            return Ok(SweepChunk {
                plan: Plan::default(),
                done: true,
            });
        };
        let wrong = wrong_pairs(&txn, room_id, ours(Some(&row))).await?;
        // Only pairs whose users this transaction holds; others next time.
        let locked: BTreeSet<&str> = candidates.iter().map(String::as_str).collect();
        let chunk = usize::try_from(SWEEP_CHUNK).unwrap_or(usize::MAX);
        let last = wrong.len() < chunk && wrong.iter().all(|p| locked.contains(p.user_id.as_str()));
        let mut rooms = RoomSnapshot::new(own.clone());
        rooms
            .rooms
            .insert(room_id.to_owned(), room_row(row.local_joined, row.sweep));
        let mut users = Vec::new();
        for pair in wrong {
            if locked.contains(pair.user_id.as_str())
                && let Ok(user) = OwnedUserId::try_from(pair.user_id.as_str())
            {
                users.push(user);
                insert_pair(&mut rooms, pair);
            }
        }
        let ids: Vec<&str> = users.iter().map(|u| u.as_str()).collect();
        load_shared(&txn, &mut rooms, &ids).await?;
        // Users only stop sharing a room we left, and untracking needs no
        // user state: the stored rows are deleted whatever they hold.
        let mut snapshot = if ours(Some(&row)) {
            super::load::snapshot(&txn, &[], &ids).await?
        } else {
            crate::decide::Snapshot::default()
        };
        snapshot.rooms = Some(rooms);
        let mut plan = plan_sweep(snapshot, room_id, &users, last, now_ms);
        super::room_writes::write(&txn, &plan.rooms, &own).await?;
        write::plan(&txn, &plan, now_ms).await?;
        txn.commit().await?;
        if last && ours(Some(&row)) {
            // Members whose pair stayed counted through a leave and a
            // rejoin of ours before this sweep (no pair of theirs was
            // wrong) share the room again: a stale mark one of them got
            // meanwhile (a dropped update) asks for its fetch now.
            plan.fetch_servers
                .extend(super::sharing::stale_servers_counted_in(&self.db, room_id).await?);
        }
        Ok(SweepChunk { plan, done: last })
    }
}

/// Remote pairs of `room` counted wrongly: `shares` is not "joined and the
/// room is ours" (`ours`). At most [`SWEEP_CHUNK`], in user order.
async fn wrong_pairs<C: ConnectionTrait>(
    db: &C,
    room_id: &RoomId,
    ours: bool,
) -> Result<Vec<room_user::Model>, DbErr> {
    let query = room_user::Entity::find()
        .filter(room_user::Column::RoomId.eq(room_id.as_str()))
        .filter(room_user::Column::Remote.eq(true));
    let query = if ours {
        // Should share exactly when joined.
        query.filter(
            sea_orm::Condition::any()
                .add(
                    sea_orm::Condition::all()
                        .add(room_user::Column::Joined.gt(0))
                        .add(room_user::Column::Shares.eq(false)),
                )
                .add(
                    sea_orm::Condition::all()
                        .add(room_user::Column::Joined.lte(0))
                        .add(room_user::Column::Shares.eq(true)),
                ),
        )
    } else {
        query.filter(room_user::Column::Shares.eq(true))
    };
    query
        .order_by_asc(room_user::Column::UserId)
        .limit(SWEEP_CHUNK)
        .all(db)
        .await
}

/// One room a user is in, as `admin rooms` shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct UserRoom {
    /// The room.
    pub room_id: String,
    /// Counted as shared with us.
    pub shares: bool,
    /// Our server is in the room.
    pub ours: bool,
    /// The joined identities through which the user is in it: its user id,
    /// or member keys whose verified link names it.
    pub identities: Vec<String>,
}

impl Store {
    /// Stored users (with a list, keys or a stale mark) that share no room
    /// with us, in user order after `after`, at most `limit`.
    pub async fn unshared_users(&self, after: &str, limit: u64) -> Result<Vec<OwnedUserId>, DbErr> {
        use sea_orm::{FromQueryResult, Statement};
        #[derive(FromQueryResult)]
        struct Row {
            user_id: String,
        }
        let backend = self.db.get_database_backend();
        // Each table gives its first `limit` unshared users after `after`
        // by its primary key (user_id leads each), so a page costs what it
        // reads, not the whole table: the first `limit` of their union are
        // the page. (A filter over the union would sort every stored user
        // on every page.)
        let (after_p, limit_p) = match backend {
            DbBackend::Postgres => ("$1", "$2"),
            _ => ("?", "?"),
        };
        let branch = |table: &str| {
            format!(
                "SELECT user_id FROM (SELECT DISTINCT user_id FROM {table} t \
                   WHERE user_id > {after_p} \
                     AND NOT EXISTS (SELECT 1 FROM shared_user s WHERE s.user_id = t.user_id) \
                   ORDER BY user_id LIMIT {limit_p}) AS {table}_page"
            )
        };
        let sql = format!(
            "SELECT user_id FROM ({} UNION {} UNION {}) AS stored ORDER BY user_id LIMIT {limit_p}",
            branch("remote_user"),
            branch("stale_user"),
            branch("cross_signing_key"),
        );
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let values: Vec<sea_orm::Value> = match backend {
            DbBackend::Postgres => vec![after.into(), limit.into()],
            // SQLite binds `?` in order.
            _ => [after.into(), limit.into()]
                .into_iter()
                .cycle()
                .take(6)
                .chain([limit.into()])
                .collect(),
        };
        let rows = Row::find_by_statement(Statement::from_sql_and_values(backend, sql, values))
            .all(&self.db)
            .await?;
        Ok(rows
            .into_iter()
            .filter_map(|r| OwnedUserId::try_from(r.user_id).ok())
            .collect())
    }

    /// Untracks those of `users` that still share no room, in one
    /// transaction under their locks (SPEC §5.5.9); a user that started
    /// sharing since it was listed stays. Returns the untracked.
    pub async fn untrack_unshared(&self, users: &[OwnedUserId]) -> Result<Vec<OwnedUserId>, DbErr> {
        let Some(own) = self.rooms_own_server().cloned() else {
            return Ok(Vec::new());
        };
        let txn = self.begin_write().await?;
        let ids: Vec<&str> = users.iter().map(|u| u.as_str()).collect();
        lock_users(&txn, &ids).await?;
        let shared: BTreeSet<OwnedUserId> = shared_counts(&txn, &ids, true)
            .await?
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .map(|(u, _)| u)
            .collect();
        let writes = RoomWrites {
            untrack: users
                .iter()
                .filter(|u| !shared.contains(*u))
                .cloned()
                .collect(),
            ..RoomWrites::default()
        };
        super::room_writes::write(&txn, &writes, &own).await?;
        txn.commit().await?;
        Ok(writes.untrack.into_iter().collect())
    }

    /// The rooms `user` is joined in, and through which identities.
    pub async fn rooms_of(&self, user: &ruma::UserId) -> Result<Vec<UserRoom>, DbErr> {
        let pairs = room_user::Entity::find()
            .filter(room_user::Column::UserId.eq(user.as_str()))
            .filter(room_user::Column::Joined.gt(0))
            .order_by_asc(room_user::Column::RoomId)
            .all(&self.db)
            .await?;
        let mut rooms = Vec::new();
        for pair in pairs {
            let ours = room::Entity::find_by_id(pair.room_id.clone())
                .one(&self.db)
                .await?
                .is_some_and(|r| r.local_joined > 0);
            let keys: Vec<String> = member_key_link::Entity::find()
                .filter(member_key_link::Column::RoomId.eq(pair.room_id.as_str()))
                .filter(member_key_link::Column::UserId.eq(user.as_str()))
                .filter(member_key_link::Column::Verified.eq(true))
                .filter(member_key_link::Column::Erased.eq(false))
                .all(&self.db)
                .await?
                .into_iter()
                .map(|l| l.member_key)
                .collect();
            let mut candidates = keys;
            candidates.push(user.as_str().to_owned());
            let mut identities: Vec<String> = room_member::Entity::find()
                .filter(room_member::Column::RoomId.eq(pair.room_id.as_str()))
                .filter(room_member::Column::Identity.is_in(candidates))
                .filter(room_member::Column::Membership.eq(Membership::Join.as_str()))
                .all(&self.db)
                .await?
                .into_iter()
                .map(|m| m.identity)
                .collect();
            identities.sort_unstable();
            rooms.push(UserRoom {
                room_id: pair.room_id,
                shares: pair.shares,
                ours,
                identities,
            });
        }
        Ok(rooms)
    }
}
