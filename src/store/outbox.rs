//! The key-change outbox: the events of each committed transaction, stored in
//! that transaction as one row, until the publisher has sent them.

use entity::key_change_outbox;
use sea_orm::{
    ActiveValue::NotSet, ActiveValue::Set, ConnectionTrait, DbErr, EntityTrait, QueryOrder,
    QuerySelect,
};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::Store;
use crate::key_change::KeyChange;

/// One event to publish on `KEY_CHANGE`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxEvent {
    /// The `user_id` header: owner of the changed keys.
    pub user_id: String,
    /// `key_change.device` or `key_change.cross_signing`.
    pub subject: String,
    /// The JSON body.
    pub payload: String,
}

/// The events one transaction recorded, under their outbox row id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxBatch {
    /// The row id; with the event's index it makes the `Nats-Msg-Id`.
    pub id: i64,
    /// The events, in the order they are published.
    pub events: Vec<OutboxEvent>,
    /// Where the batch came from and when each of its causes began, for the
    /// latency metric (None: read back from the table).
    pub origin: Option<Origin>,
}

/// The causes of a batch's events, for `dlu_update_to_key_change_seconds`:
/// one observation per cause once the events are in `KEY_CHANGE`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    /// `update` (input messages) or `fetch` (stale marks of fetched users).
    pub source: &'static str,
    /// When each cause began: an input message entering JetStream, or a
    /// user being marked stale.
    pub since: Vec<std::time::SystemTime>,
}

impl OutboxEvent {
    /// The wire form of a key change.
    pub fn from_change(change: &KeyChange) -> OutboxEvent {
        OutboxEvent {
            user_id: change.user_id().to_string(),
            subject: change.subject().to_owned(),
            payload: change.to_json(),
        }
    }
}

/// How an event is stored inside the row's JSON array.
#[derive(Deserialize)]
struct StoredEvent {
    user_id: String,
    subject: String,
    payload: Box<RawValue>,
}

/// Encodes events as the row's JSON array. Payloads are JSON already and are
/// embedded as they are, not re-escaped as strings.
fn encode(events: &[OutboxEvent]) -> String {
    let size: usize = events.iter().map(|e| e.payload.len() + 96).sum();
    let mut out = String::with_capacity(size + 2);
    out.push('[');
    for (i, event) in events.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"user_id\":");
        out.push_str(&serde_json::Value::from(event.user_id.as_str()).to_string());
        out.push_str(",\"subject\":");
        out.push_str(&serde_json::Value::from(event.subject.as_str()).to_string());
        out.push_str(",\"payload\":");
        out.push_str(&event.payload);
        out.push('}');
    }
    out.push(']');
    out
}

fn decode(row: key_change_outbox::Model) -> Result<OutboxBatch, DbErr> {
    let stored: Vec<StoredEvent> = serde_json::from_str(&row.events)
        .map_err(|e| DbErr::Custom(format!("outbox row {} is not an event list: {e}", row.id)))?;
    Ok(OutboxBatch {
        origin: None,
        id: row.id,
        events: stored
            .into_iter()
            .map(|e| OutboxEvent {
                user_id: e.user_id,
                subject: e.subject,
                payload: e.payload.get().to_owned(),
            })
            .collect(),
    })
}

/// Records `events` as one outbox row inside the caller's transaction;
/// returns the row id (None when there is nothing to record).
pub(super) async fn record<C: ConnectionTrait>(
    db: &C,
    events: &[OutboxEvent],
    now_ms: i64,
) -> Result<Option<i64>, DbErr> {
    if events.is_empty() {
        return Ok(None);
    }
    let row = key_change_outbox::ActiveModel {
        id: NotSet,
        events: Set(encode(events)),
        event_count: Set(i32::try_from(events.len()).unwrap_or(i32::MAX)),
        created_at_ms: Set(now_ms),
    };
    let inserted = key_change_outbox::Entity::insert(row).exec(db).await?;
    Ok(Some(inserted.last_insert_id))
}

impl Store {
    /// Unpublished batches with an id above `after`, oldest first, at most
    /// `limit`. A row that cannot be decoded (only possible if it was edited
    /// by hand) is logged and skipped, so it cannot block the others; it
    /// stays in the table for an operator to look at.
    pub async fn outbox_pending(&self, after: i64, limit: u64) -> Result<Vec<OutboxBatch>, DbErr> {
        use sea_orm::{ColumnTrait, QueryFilter};
        let rows = key_change_outbox::Entity::find()
            .filter(key_change_outbox::Column::Id.gt(after))
            .order_by_asc(key_change_outbox::Column::Id)
            .limit(limit)
            .all(&self.db)
            .await?;
        Ok(rows
            .into_iter()
            .filter_map(|row| {
                decode(row)
                    .inspect_err(
                        |e| tracing::error!(error = %e, "skipping an unreadable outbox row"),
                    )
                    .ok()
            })
            .collect())
    }

    /// Deletes published batches (deleting one already gone is not an error).
    pub async fn outbox_delete(&self, ids: &[i64]) -> Result<(), DbErr> {
        use sea_orm::QueryFilter;
        let backend = self.db.get_database_backend();
        let ids = ids.iter().copied();
        for these in super::one_of::one_of(backend, key_change_outbox::Column::Id, ids) {
            key_change_outbox::Entity::delete_many()
                .filter(these)
                .exec(&self.db)
                .await?;
        }
        Ok(())
    }

    /// How many batches wait to be published.
    pub async fn outbox_len(&self) -> Result<u64, DbErr> {
        use sea_orm::PaginatorTrait;
        key_change_outbox::Entity::find().count(&self.db).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_survive_the_row_encoding() {
        let events = vec![
            OutboxEvent {
                user_id: "@a\"b:example.org".into(),
                subject: "key_change.device".into(),
                payload: r#"{"type":"device","keys":{"k":"v\n"}}"#.into(),
            },
            OutboxEvent {
                user_id: "@c:example.org".into(),
                subject: "key_change.cross_signing".into(),
                payload: r#"{"type":"cross_signing"}"#.into(),
            },
        ];
        let row = key_change_outbox::Model {
            id: 7,
            events: encode(&events),
            event_count: 2,
            created_at_ms: 0,
        };
        assert_eq!(
            decode(row).unwrap(),
            OutboxBatch {
                id: 7,
                events,
                origin: None
            }
        );
    }

    #[test]
    fn a_corrupt_row_is_an_error_not_a_panic() {
        let row = key_change_outbox::Model {
            id: 1,
            events: "not json".into(),
            event_count: 0,
            created_at_ms: 0,
        };
        assert!(decode(row).is_err());
    }
}
