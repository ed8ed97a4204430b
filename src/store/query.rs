//! Reading what is stored about users, for the query RPC (SPEC §4.4).

use std::collections::BTreeMap;

use entity::{cross_signing_key, remote_device, remote_user, stale_user};
use sea_orm::{ColumnTrait, DbErr, EntityTrait, QueryFilter};

use super::Store;

/// One device as stored.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceView {
    /// Its display name.
    pub display_name: Option<String>,
    /// Its keys JSON as received.
    pub keys: Option<String>,
}

/// What is stored about one user.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UserView {
    /// Anything is stored, or the user is stale.
    pub tracked: bool,
    /// The user is marked stale.
    pub stale: bool,
    /// The highest stream id stored (None when untracked).
    pub stream_id: Option<i64>,
    /// Devices, without tombstones.
    pub devices: BTreeMap<String, DeviceView>,
    /// The master key JSON.
    pub master_key: Option<String>,
    /// The self-signing key JSON.
    pub self_signing_key: Option<String>,
    /// With membership on: the rooms the user shares with us (SPEC §4.4).
    pub shared_rooms: Option<u32>,
}

impl Store {
    /// What is stored about each of `users` (every one appears).
    pub async fn query_users(&self, users: &[String]) -> Result<BTreeMap<String, UserView>, DbErr> {
        let mut views: BTreeMap<String, UserView> = users
            .iter()
            .map(|u| (u.clone(), UserView::default()))
            .collect();
        let ids = || users.iter().map(String::as_str);
        for row in remote_user::Entity::find()
            .filter(remote_user::Column::UserId.is_in(ids()))
            .all(&self.db)
            .await?
        {
            if let Some(view) = views.get_mut(&row.user_id) {
                view.tracked = true;
                view.stream_id = Some(row.max_stream_id);
            }
        }
        for row in stale_user::Entity::find()
            .filter(stale_user::Column::UserId.is_in(ids()))
            .all(&self.db)
            .await?
        {
            if let Some(view) = views.get_mut(&row.user_id) {
                view.tracked = true;
                view.stale = true;
            }
        }
        for row in remote_device::Entity::find()
            .filter(remote_device::Column::UserId.is_in(ids()))
            .filter(remote_device::Column::Deleted.eq(false))
            .all(&self.db)
            .await?
        {
            if let Some(view) = views.get_mut(&row.user_id) {
                view.tracked = true;
                view.devices.insert(
                    row.device_id,
                    DeviceView {
                        display_name: row.display_name,
                        keys: row.keys_json,
                    },
                );
            }
        }
        for row in cross_signing_key::Entity::find()
            .filter(cross_signing_key::Column::UserId.is_in(ids()))
            .all(&self.db)
            .await?
        {
            if let Some(view) = views.get_mut(&row.user_id) {
                view.tracked = true;
                match row.key_usage.as_str() {
                    "master" => view.master_key = Some(row.key_json),
                    "self_signing" => view.self_signing_key = Some(row.key_json),
                    _ => {}
                }
            }
        }
        if self.membership() {
            self.add_sharing(users, &mut views).await?;
        }
        Ok(views)
    }

    /// With rooms deciding: each view's shared rooms now, and a user whose
    /// rooms are all rooms our server left shown untracked.
    async fn add_sharing(
        &self,
        users: &[String],
        views: &mut BTreeMap<String, UserView>,
    ) -> Result<(), DbErr> {
        let ids: Vec<&str> = users.iter().map(String::as_str).collect();
        let shared = self.shared_rooms(&ids).await?;
        // Counted in rooms, but in none that is ours now: our server
        // left them and their sweep has not removed this user's rows
        // yet. It is untracked from the leave on (SPEC §5.5.4).
        let leaving: std::collections::BTreeSet<ruma::OwnedUserId> =
            super::rooms::shared_counts(&self.db, &ids, false)
                .await?
                .into_iter()
                .filter(|(user, n)| *n > 0 && !shared.contains_key(user))
                .map(|(user, _)| user)
                .collect();
        for (user, view) in views.iter_mut() {
            let user = ruma::UserId::parse(user.as_str()).ok();
            if user.as_ref().is_some_and(|u| leaving.contains(u)) {
                *view = UserView::default();
            }
            let count = user.and_then(|u| shared.get(&u).copied());
            view.shared_rooms = Some(count.unwrap_or(0));
        }
        Ok(())
    }
}
