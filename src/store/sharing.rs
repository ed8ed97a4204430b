//! Whether a user shares a room with us *now* (SPEC §5.5.1, §5.5.4): the one
//! definition every reader uses (the fetch writer, the fetch jobs' choice of
//! users, the RPCs, a batch's snapshot).
//!
//! A (room, user) pair counts when it is marked as sharing (`room_user.shares`)
//! and the room is ours at this moment (`room.local_joined > 0`). A room our
//! server has left is therefore not ours for any decision from the moment the
//! leave is applied, although its sweep removes the members' rows only later;
//! a room our server has joined counts for a member once its sweep has
//! reached him (until then he is treated as before the join). The stored
//! per-user count (`shared_user`) is only the sweeps' bookkeeping: it may
//! still include rooms we left.

use entity::{room, room_user, stale_user};
use ruma::OwnedUserId;
use sea_orm::sea_query::{Alias, Expr, ExprTrait as _, IntoColumnRef, Query, SelectStatement};
use sea_orm::{ConnectionTrait, DbErr, FromQueryResult};

use super::one_of::one_of;

/// The pairs of `users` that count now, joined with their rooms.
fn counted_pairs() -> SelectStatement {
    Query::select()
        .from(room_user::Entity)
        .inner_join(
            room::Entity,
            Expr::col((room::Entity, room::Column::RoomId))
                .equals((room_user::Entity, room_user::Column::RoomId)),
        )
        .and_where(Expr::col((room_user::Entity, room_user::Column::Shares)).eq(true))
        .and_where(Expr::col((room::Entity, room::Column::LocalJoined)).gt(0))
        .to_owned()
}

/// How many rooms each of `users` shares with us now (absent: none).
pub(super) async fn rooms_shared_now<C: ConnectionTrait>(
    db: &C,
    users: &[&str],
) -> Result<Vec<(OwnedUserId, u32)>, DbErr> {
    #[derive(FromQueryResult)]
    struct Row {
        user_id: String,
        n: i64,
    }
    let user_col = (room_user::Entity, room_user::Column::UserId);
    let mut counts = Vec::new();
    let backend = db.get_database_backend();
    for these in one_of(backend, user_col, users.iter().copied()) {
        let query = counted_pairs()
            .column(user_col)
            .expr_as(Expr::col(user_col).count(), Alias::new("n"))
            .and_where(these)
            .group_by_col(user_col)
            .to_owned();
        let statement = backend.build(&query);
        for row in Row::find_by_statement(statement).all(db).await? {
            if let Ok(user) = OwnedUserId::try_from(row.user_id) {
                counts.push((user, u32::try_from(row.n).unwrap_or(u32::MAX)));
            }
        }
    }
    Ok(counts)
}

/// A condition on `stale_user` rows: the user shares a room with us now.
/// With membership on, only such users are fetched (SPEC §5.2: no request
/// for a user who shares nothing; §5.5.9).
pub(super) fn stale_user_shares_now() -> Expr {
    shares_now((stale_user::Entity, stale_user::Column::UserId))
}

/// A condition on rows whose user id is `user`: that user shares a room
/// with us now.
pub(super) fn shares_now(user: impl IntoColumnRef) -> Expr {
    Expr::exists(
        counted_pairs()
            .expr(Expr::val(1))
            .and_where(Expr::col((room_user::Entity, room_user::Column::UserId)).equals(user))
            .to_owned(),
    )
}

/// The servers of stale users whose pair in `room` is counted as sharing.
pub(super) async fn stale_servers_counted_in<C: ConnectionTrait>(
    db: &C,
    room: &ruma::RoomId,
) -> Result<Vec<ruma::OwnedServerName>, DbErr> {
    #[derive(FromQueryResult)]
    struct Row {
        server_name: String,
    }
    let query = Query::select()
        .distinct()
        .column((stale_user::Entity, stale_user::Column::ServerName))
        .from(stale_user::Entity)
        .inner_join(
            room_user::Entity,
            Expr::col((room_user::Entity, room_user::Column::UserId))
                .equals((stale_user::Entity, stale_user::Column::UserId)),
        )
        .and_where(Expr::col((room_user::Entity, room_user::Column::RoomId)).eq(room.as_str()))
        .and_where(Expr::col((room_user::Entity, room_user::Column::Shares)).eq(true))
        .to_owned();
    let statement = db.get_database_backend().build(&query);
    Ok(Row::find_by_statement(statement)
        .all(db)
        .await?
        .into_iter()
        .filter_map(|row| ruma::OwnedServerName::try_from(row.server_name).ok())
        .collect())
}
