//! Gathering what tasks hand over a few milliseconds apart, so that one
//! statement serves them all: fetch jobs start and end one by one as pulls
//! deliver them and servers answer, and their lists arrive one by one; a
//! statement (or transaction) for each was most of the fan-out's
//! statements.

use std::time::Duration;

use tokio::sync::mpsc;

/// How long a gathering may go on.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gathering {
    /// It ends once nothing more was handed over for this long: a task
    /// whose next item waits for this one's answer (a job fetching its
    /// server's users one by one, alone) is held up by no more than this.
    pub gap: Duration,
    /// It ends this long after the first item at the latest.
    pub window: Duration,
    /// It ends with this many items.
    pub most: usize,
}

/// The next items to serve together: the first handed over, and those
/// that follow it, each within `how.gap` of the one before, for at most
/// `how.window` and `how.most` items (None once every handle is gone and
/// the queue is empty).
pub(crate) async fn gather<T>(queue: &mut mpsc::Receiver<T>, how: Gathering) -> Option<Vec<T>> {
    let first = queue.recv().await?;
    let mut items = vec![first];
    let until = tokio::time::Instant::now() + how.window;
    while items.len() < how.most {
        let next_by = (tokio::time::Instant::now() + how.gap).min(until);
        match tokio::time::timeout_at(next_by, queue.recv()).await {
            Ok(Some(item)) => items.push(item),
            // A gap, the window over, or every handle gone (stopping):
            // serve what was gathered.
            Ok(None) | Err(_) => break,
        }
    }
    Some(items)
}

/// `items` in order, cut into runs in which no key comes twice: an item
/// whose key is already in the run starts the next one.
pub(crate) fn without_repeats<T, K: Ord>(items: Vec<T>, key: impl Fn(&T) -> K) -> Vec<Vec<T>> {
    let mut runs = Vec::new();
    let mut run = Vec::new();
    let mut keys = std::collections::BTreeSet::new();
    for item in items {
        if !keys.insert(key(&item)) {
            runs.push(std::mem::take(&mut run));
            keys.clear();
            keys.insert(key(&item));
        }
        run.push(item);
    }
    if !run.is_empty() {
        runs.push(run);
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Items handed over one after another, each within the gap, are
    /// served together, at most `most` at once and for at most the window;
    /// a gap ends the gathering; the last comes once every handle is gone.
    #[tokio::test(start_paused = true)]
    async fn gathers_until_a_gap_or_the_window() {
        let (tx, mut rx) = mpsc::channel(16);
        let how = Gathering {
            gap: Duration::from_millis(5),
            window: Duration::from_millis(50),
            most: 4,
        };
        let sender = tokio::spawn(async move {
            let pause = |ms| tokio::time::sleep(Duration::from_millis(ms));
            for i in 0..3 {
                tx.send(i).await.unwrap();
                pause(2).await;
            }
            // A gap: 3 starts the next gathering.
            pause(10).await;
            for i in 3..9 {
                tx.send(i).await.unwrap();
            }
            pause(10).await;
            // Within the gap of each other, but past the window.
            for i in 9..30 {
                tx.send(i).await.unwrap();
                pause(4).await;
            }
        });
        assert_eq!(gather(&mut rx, how).await, Some(vec![0, 1, 2]));
        assert_eq!(
            gather(&mut rx, how).await,
            Some(vec![3, 4, 5, 6]),
            "at most four"
        );
        assert_eq!(gather(&mut rx, how).await, Some(vec![7, 8]));
        let wide = Gathering { most: 100, ..how };
        assert_eq!(
            gather(&mut rx, wide).await,
            Some((9..22).collect()),
            "the window"
        );
        sender.await.unwrap();
        assert_eq!(gather(&mut rx, wide).await, Some((22..30).collect()));
        assert_eq!(gather(&mut rx, wide).await, None);
    }

    #[test]
    fn runs_without_repeats() {
        /// An item: its key and which of that key's items it is.
        type Item = (char, u8);
        let key = |item: &Item| item.0;
        let table: [(&[Item], &[&[Item]]); 4] = [
            (&[], &[]),
            (&[('a', 1), ('b', 1)], &[&[('a', 1), ('b', 1)]]),
            (
                &[('a', 1), ('b', 1), ('a', 2), ('c', 1), ('b', 2)],
                &[&[('a', 1), ('b', 1)], &[('a', 2), ('c', 1), ('b', 2)]],
            ),
            (
                &[('a', 1), ('a', 2), ('a', 3)],
                &[&[('a', 1)], &[('a', 2)], &[('a', 3)]],
            ),
        ];
        for (items, runs) in table {
            let expected: Vec<Vec<Item>> = runs.iter().map(|r| r.to_vec()).collect();
            assert_eq!(without_repeats(items.to_vec(), key), expected, "{items:?}");
        }
    }
}
