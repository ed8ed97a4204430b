//! PostgreSQL statements for the room tables (SPEC §5.5, §5.6), one array
//! per column as in `bulk.rs`: fixed statement text prepared once per
//! connection, a handful of values instead of a parameter per cell. A
//! membership snapshot writes thousands of room rows per second and a room
//! sweep untracks thousands of users per transaction; `BENCHMARKS.md`
//! measures both. SQLite keeps the portable statements in `rooms.rs`.

use ruma::ServerName;
use sea_orm::{ConnectionTrait, DbBackend, DbErr, Statement, Value};

use super::rows::to_i32;
use crate::decide::RoomWrites;

/// Every stored row of the users given, in one round trip (SPEC §5.5.4).
const UNTRACK: &str = "WITH d AS (DELETE FROM remote_device WHERE user_id = ANY($1::text[])), \
     u AS (DELETE FROM remote_user WHERE user_id = ANY($1::text[])), \
     s AS (DELETE FROM stale_user WHERE user_id = ANY($1::text[])), \
     q AS (DELETE FROM revalidation WHERE user_id = ANY($1::text[])) \
     DELETE FROM cross_signing_key WHERE user_id = ANY($1::text[])";

const UPSERT_ROOMS: &str = "INSERT INTO room (room_id, local_joined, sweep) \
     SELECT * FROM UNNEST($1::text[], $2::int4[], $3::bool[]) \
     ON CONFLICT (room_id) DO UPDATE SET \
     local_joined = EXCLUDED.local_joined, sweep = EXCLUDED.sweep";

const UPSERT_MEMBERS: &str = "INSERT INTO room_member \
     (room_id, identity, membership, stream_ordering) \
     SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::int8[]) \
     ON CONFLICT (room_id, identity) DO UPDATE SET \
     membership = EXCLUDED.membership, stream_ordering = EXCLUDED.stream_ordering";

/// The driver's arrays cannot hold NULL: an unknown user travels as a
/// "present" flag beside the text.
const UPSERT_LINKS: &str = "INSERT INTO member_key_link \
     (room_id, member_key, user_id, erased, verified, stream_ordering) \
     SELECT r, k, CASE WHEN has_user THEN u END, e, v, s \
     FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bool[], $5::bool[], $6::bool[], \
                 $7::int8[]) AS t(r, k, u, has_user, e, v, s) \
     ON CONFLICT (room_id, member_key) DO UPDATE SET \
     user_id = EXCLUDED.user_id, erased = EXCLUDED.erased, verified = EXCLUDED.verified, \
     stream_ordering = EXCLUDED.stream_ordering";

const UPSERT_ROOM_USERS: &str = "INSERT INTO room_user \
     (room_id, user_id, remote, joined, shares) \
     SELECT * FROM UNNEST($1::text[], $2::text[], $3::bool[], $4::int4[], $5::bool[]) \
     ON CONFLICT (room_id, user_id) DO UPDATE SET \
     joined = EXCLUDED.joined, shares = EXCLUDED.shares";

const DELETE_SHARED: &str = "DELETE FROM shared_user WHERE user_id = ANY($1::text[])";

const UPSERT_SHARED: &str = "INSERT INTO shared_user (user_id, server_name, shared_rooms) \
     SELECT * FROM UNNEST($1::text[], $2::text[], $3::int4[]) \
     ON CONFLICT (user_id) DO UPDATE SET shared_rooms = EXCLUDED.shared_rooms";

async fn run<C: ConnectionTrait>(db: &C, sql: &str, values: Vec<Value>) -> Result<(), DbErr> {
    db.execute_raw(Statement::from_sql_and_values(
        DbBackend::Postgres,
        sql,
        values,
    ))
    .await?;
    Ok(())
}

/// Writes `writes` as `room_writes::write` does, a statement per table.
pub(super) async fn write<C: ConnectionTrait>(
    db: &C,
    writes: &RoomWrites,
    own: &ServerName,
) -> Result<(), DbErr> {
    let (gone, counts) = shared_counts(writes);
    let statements = [
        untrack(writes),
        rooms(writes),
        members(writes),
        links(writes),
        pairs(writes, own),
        gone,
        counts,
    ];
    for (sql, values) in statements.into_iter().flatten() {
        run(db, sql, values).await?;
    }
    Ok(())
}

/// A statement and its array parameters; None when it has nothing to write.
type Arrays = Option<(&'static str, Vec<Value>)>;

/// Everything stored about the users that stopped sharing.
fn untrack(writes: &RoomWrites) -> Arrays {
    if writes.untrack.is_empty() {
        return None;
    }
    let users: Vec<String> = writes.untrack.iter().map(ToString::to_string).collect();
    Some((UNTRACK, vec![users.into()]))
}

/// Room rows.
fn rooms(writes: &RoomWrites) -> Arrays {
    if writes.rooms.is_empty() {
        return None;
    }
    let ids: Vec<String> = writes.rooms.keys().map(ToString::to_string).collect();
    let joined: Vec<i32> = writes
        .rooms
        .values()
        .map(|r| to_i32(r.local_joined))
        .collect();
    let sweep: Vec<bool> = writes.rooms.values().map(|r| r.sweep).collect();
    Some((UPSERT_ROOMS, vec![ids.into(), joined.into(), sweep.into()]))
}

/// Memberships of identities in rooms.
fn members(writes: &RoomWrites) -> Arrays {
    if writes.members.is_empty() {
        return None;
    }
    let rooms: Vec<String> = writes.members.keys().map(|(r, _)| r.to_string()).collect();
    let identities: Vec<String> = writes
        .members
        .keys()
        .map(|(_, i)| i.as_str().to_owned())
        .collect();
    let memberships: Vec<String> = writes
        .members
        .values()
        .map(|m| m.membership.as_str().to_owned())
        .collect();
    let orderings: Vec<i64> = writes.members.values().map(|m| m.stream_ordering).collect();
    let values = vec![
        rooms.into(),
        identities.into(),
        memberships.into(),
        orderings.into(),
    ];
    Some((UPSERT_MEMBERS, values))
}

/// Member-key links.
fn links(writes: &RoomWrites) -> Arrays {
    if writes.links.is_empty() {
        return None;
    }
    let rooms: Vec<String> = writes.links.keys().map(|(r, _)| r.to_string()).collect();
    let keys: Vec<String> = writes
        .links
        .keys()
        .map(|(_, k)| k.as_str().to_owned())
        .collect();
    let links = writes.links.values();
    let users: Vec<String> = links
        .clone()
        .map(|l| l.user.as_ref().map(ToString::to_string).unwrap_or_default())
        .collect();
    let has_user: Vec<bool> = links.clone().map(|l| l.user.is_some()).collect();
    let erased: Vec<bool> = links.clone().map(|l| l.erased).collect();
    let verified: Vec<bool> = links.clone().map(|l| l.verified).collect();
    let orderings: Vec<i64> = links.map(|l| l.stream_ordering).collect();
    let values = vec![
        rooms.into(),
        keys.into(),
        users.into(),
        has_user.into(),
        erased.into(),
        verified.into(),
        orderings.into(),
    ];
    Some((UPSERT_LINKS, values))
}

/// (room, user) pairs. `remote` is stored so the sweep selects remote pairs
/// without parsing user ids.
fn pairs(writes: &RoomWrites, own: &ServerName) -> Arrays {
    if writes.room_users.is_empty() {
        return None;
    }
    let pairs = writes.room_users.iter();
    let rooms: Vec<String> = pairs.clone().map(|((r, _), _)| r.to_string()).collect();
    let users: Vec<String> = pairs.clone().map(|((_, u), _)| u.to_string()).collect();
    let remote: Vec<bool> = pairs
        .clone()
        .map(|((_, u), _)| u.server_name() != own)
        .collect();
    let joined: Vec<i32> = pairs.clone().map(|(_, p)| to_i32(p.joined)).collect();
    let shares: Vec<bool> = pairs.map(|(_, p)| p.shares).collect();
    let values = vec![
        rooms.into(),
        users.into(),
        remote.into(),
        joined.into(),
        shares.into(),
    ];
    Some((UPSERT_ROOM_USERS, values))
}

/// Shared-room counts: the rows to delete (a count of zero) and to upsert.
fn shared_counts(writes: &RoomWrites) -> (Arrays, Arrays) {
    let (gone, counts): (Vec<_>, Vec<_>) = writes.shared.iter().partition(|(_, n)| **n == 0);
    let gone = (!gone.is_empty()).then(|| {
        let users: Vec<String> = gone.iter().map(|(u, _)| u.to_string()).collect();
        (DELETE_SHARED, vec![users.into()])
    });
    let counts = (!counts.is_empty()).then(|| {
        let users: Vec<String> = counts.iter().map(|(u, _)| u.to_string()).collect();
        let servers: Vec<String> = counts
            .iter()
            .map(|(u, _)| u.server_name().to_string())
            .collect();
        let shared: Vec<i32> = counts.iter().map(|(_, n)| to_i32(**n)).collect();
        (
            UPSERT_SHARED,
            vec![users.into(), servers.into(), shared.into()],
        )
    });
    (gone, counts)
}
