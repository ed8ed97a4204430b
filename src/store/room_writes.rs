//! Writing a plan's room rows ([`RoomWrites`]), one step per table.
//! Untracking comes first: every row of the users that stopped sharing goes,
//! in this transaction (SPEC §5.5.4); rows the same plan writes for them
//! afterwards (a rejoin) then stand. PostgreSQL takes the array statements
//! of `bulk_rooms.rs`; these are the portable ones.

use entity::{
    cross_signing_key, member_key_link, remote_device, remote_user, revalidation, room,
    room_member, room_user, shared_user, stale_user,
};
use ruma::ServerName;
use sea_orm::sea_query::OnConflict;
use sea_orm::{
    ActiveValue::Set, ColumnTrait, ConnectionTrait, DbBackend, DbErr, EntityTrait, QueryFilter,
};

use super::rows::{CHUNK, to_i32};
use super::write::upsert;
use crate::decide::RoomWrites;

/// Writes the room rows of a plan, `own` being our server.
pub(super) async fn write<C: ConnectionTrait>(
    db: &C,
    writes: &RoomWrites,
    own: &ServerName,
) -> Result<(), DbErr> {
    if db.get_database_backend() == DbBackend::Postgres {
        return super::bulk_rooms::write(db, writes, own).await;
    }
    untrack(db, writes).await?;
    rooms(db, writes).await?;
    members(db, writes).await?;
    links(db, writes).await?;
    pairs(db, writes, own).await?;
    counts(db, writes).await
}

/// Deletes everything stored about the users that stopped sharing.
async fn untrack<C: ConnectionTrait>(db: &C, writes: &RoomWrites) -> Result<(), DbErr> {
    let untrack: Vec<&str> = writes.untrack.iter().map(|u| u.as_str()).collect();
    for chunk in untrack.chunks(CHUNK) {
        let ids = || chunk.iter().copied();
        remote_device::Entity::delete_many()
            .filter(remote_device::Column::UserId.is_in(ids()))
            .exec(db)
            .await?;
        remote_user::Entity::delete_many()
            .filter(remote_user::Column::UserId.is_in(ids()))
            .exec(db)
            .await?;
        stale_user::Entity::delete_many()
            .filter(stale_user::Column::UserId.is_in(ids()))
            .exec(db)
            .await?;
        revalidation::Entity::delete_many()
            .filter(revalidation::Column::UserId.is_in(ids()))
            .exec(db)
            .await?;
        cross_signing_key::Entity::delete_many()
            .filter(cross_signing_key::Column::UserId.is_in(ids()))
            .exec(db)
            .await?;
    }
    Ok(())
}

/// Room rows.
async fn rooms<C: ConnectionTrait>(db: &C, writes: &RoomWrites) -> Result<(), DbErr> {
    let rooms: Vec<room::ActiveModel> = writes
        .rooms
        .iter()
        .map(|(id, row)| room::ActiveModel {
            room_id: Set(id.to_string()),
            local_joined: Set(to_i32(row.local_joined)),
            sweep: Set(row.sweep),
        })
        .collect();
    upsert(
        db,
        &rooms,
        OnConflict::column(room::Column::RoomId)
            .update_columns([room::Column::LocalJoined, room::Column::Sweep])
            .to_owned(),
    )
    .await
}

/// Memberships of identities in rooms.
async fn members<C: ConnectionTrait>(db: &C, writes: &RoomWrites) -> Result<(), DbErr> {
    let members: Vec<room_member::ActiveModel> = writes
        .members
        .iter()
        .map(|((room, identity), member)| room_member::ActiveModel {
            room_id: Set(room.to_string()),
            identity: Set(identity.as_str().to_owned()),
            membership: Set(member.membership.as_str().to_owned()),
            stream_ordering: Set(member.stream_ordering),
        })
        .collect();
    upsert(
        db,
        &members,
        OnConflict::columns([room_member::Column::RoomId, room_member::Column::Identity])
            .update_columns([
                room_member::Column::Membership,
                room_member::Column::StreamOrdering,
            ])
            .to_owned(),
    )
    .await
}

/// Member-key links.
async fn links<C: ConnectionTrait>(db: &C, writes: &RoomWrites) -> Result<(), DbErr> {
    let links: Vec<member_key_link::ActiveModel> = writes
        .links
        .iter()
        .map(|((room, key), link)| member_key_link::ActiveModel {
            room_id: Set(room.to_string()),
            member_key: Set(key.as_str().to_owned()),
            user_id: Set(link.user.as_ref().map(ToString::to_string)),
            erased: Set(link.erased),
            verified: Set(link.verified),
            stream_ordering: Set(link.stream_ordering),
        })
        .collect();
    upsert(
        db,
        &links,
        OnConflict::columns([
            member_key_link::Column::RoomId,
            member_key_link::Column::MemberKey,
        ])
        .update_columns([
            member_key_link::Column::UserId,
            member_key_link::Column::Erased,
            member_key_link::Column::Verified,
            member_key_link::Column::StreamOrdering,
        ])
        .to_owned(),
    )
    .await
}

/// (room, user) pairs.
async fn pairs<C: ConnectionTrait>(
    db: &C,
    writes: &RoomWrites,
    own: &ServerName,
) -> Result<(), DbErr> {
    // `remote` is stored so the sweep selects remote pairs without
    // parsing user ids.
    let pairs: Vec<room_user::ActiveModel> = writes
        .room_users
        .iter()
        .map(|((room, user), pair)| room_user::ActiveModel {
            room_id: Set(room.to_string()),
            remote: Set(user.server_name() != own),
            user_id: Set(user.to_string()),
            joined: Set(to_i32(pair.joined)),
            shares: Set(pair.shares),
        })
        .collect();
    upsert(
        db,
        &pairs,
        OnConflict::columns([room_user::Column::RoomId, room_user::Column::UserId])
            .update_columns([room_user::Column::Joined, room_user::Column::Shares])
            .to_owned(),
    )
    .await
}

/// Shared-room counts (a count of zero deletes the row).
async fn counts<C: ConnectionTrait>(db: &C, writes: &RoomWrites) -> Result<(), DbErr> {
    let gone: Vec<&str> = writes
        .shared
        .iter()
        .filter(|(_, n)| **n == 0)
        .map(|(u, _)| u.as_str())
        .collect();
    for chunk in gone.chunks(CHUNK) {
        shared_user::Entity::delete_many()
            .filter(shared_user::Column::UserId.is_in(chunk.iter().copied()))
            .exec(db)
            .await?;
    }
    let counts: Vec<shared_user::ActiveModel> = writes
        .shared
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(user, n)| shared_user::ActiveModel {
            user_id: Set(user.to_string()),
            server_name: Set(user.server_name().to_string()),
            shared_rooms: Set(to_i32(*n)),
        })
        .collect();
    upsert(
        db,
        &counts,
        OnConflict::column(shared_user::Column::UserId)
            .update_column(shared_user::Column::SharedRooms)
            .to_owned(),
    )
    .await
}
