//! What jobs read as they start (SPEC §5.2), read for many at once. A pull
//! delivers up to a replica's free job slots together and each job began
//! with a statement of its own (its server's wait and first round of due
//! stale users: [`Store::job_start`]). Here one task gathers the jobs that
//! start within a few milliseconds and reads them all in one statement
//! ([`Store::job_starts`]; on SQLite, in-process, each alone as before).

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::time::Duration;

use ruma::OwnedServerName;
use sea_orm::DbErr;
use tokio::sync::{mpsc, oneshot};

use crate::fetch::gather::{Gathering, gather};
use crate::store::{JobStart, Store, now_ms};

/// How starting jobs are gathered. The jobs of one pull start within
/// microseconds of each other: each within 1 ms of the one before, for up
/// to 5 ms, and at most 64 (each brings up to a round of users, so this
/// bounds the rows one statement holds). A job alone waits 1 ms.
const GATHER: Gathering = Gathering {
    gap: Duration::from_millis(1),
    window: Duration::from_millis(5),
    most: 64,
};

/// A job's question and where its answer goes.
type Asked = (OwnedServerName, oneshot::Sender<Result<JobStart, DbErr>>);

/// Hands starting jobs' servers to the task that reads their starts.
#[derive(Clone)]
pub struct JobStarts {
    queue: mpsc::Sender<Asked>,
}

impl JobStarts {
    /// The handle and its task, for the caller to run; `round`: the stale
    /// users read per job. The task ends once every handle is dropped.
    pub fn new(store: Store, round: u64) -> (JobStarts, impl Future<Output = ()> + Send + 'static) {
        let (tx, rx) = mpsc::channel(GATHER.most * 4);
        (JobStarts { queue: tx }, run(store, round, rx))
    }

    /// What `server`'s job reads as it starts now ([`Store::job_start`]).
    pub async fn start(&self, server: &OwnedServerName) -> Result<JobStart, DbErr> {
        let (reply, answer) = oneshot::channel();
        let stopped = || DbErr::Custom("the job-start reader has stopped".into());
        self.queue
            .send((server.clone(), reply))
            .await
            .map_err(|_| stopped())?;
        answer.await.unwrap_or_else(|_| Err(stopped()))
    }
}

async fn run(store: Store, round: u64, mut queue: mpsc::Receiver<Asked>) {
    while let Some(asked) = gather(&mut queue, GATHER).await {
        let servers: BTreeSet<OwnedServerName> =
            asked.iter().map(|(server, _)| server.clone()).collect();
        let mut starts = match store.job_starts(&servers, now_ms(), round).await {
            Ok(starts) => starts,
            Err(e) => {
                let reason = e.to_string();
                for (_, reply) in asked {
                    let _ = reply.send(Err(DbErr::Custom(reason.clone())));
                }
                continue;
            }
        };
        answer(&mut starts, asked);
    }
}

/// Sends each job its server's start (a server asked twice, by a job
/// delivered again, gets the same start twice).
fn answer(starts: &mut BTreeMap<OwnedServerName, JobStart>, asked: Vec<Asked>) {
    for (server, reply) in asked {
        let start = starts
            .get(&server)
            .cloned()
            .ok_or_else(|| DbErr::Custom(format!("no job start was read for {server}")));
        let _ = reply.send(start);
    }
}
