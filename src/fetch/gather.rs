//! Gathering what tasks hand over a few milliseconds apart, so that one
//! statement serves them all: fetch jobs start and end one by one as pulls
//! deliver them and servers answer, and their lists arrive one by one; a
//! statement (or transaction) for each was most of the fan-out's
//! statements.

use std::time::Duration;

use tokio::sync::mpsc;

/// The next items to serve together: the first handed over, and those
/// handed over within `window` of it, at most `most` (None once every
/// handle is gone and the queue is empty).
pub(crate) async fn gather<T>(
    queue: &mut mpsc::Receiver<T>,
    window: Duration,
    most: usize,
) -> Option<Vec<T>> {
    let first = queue.recv().await?;
    let mut items = vec![first];
    let until = tokio::time::Instant::now() + window;
    while items.len() < most {
        match tokio::time::timeout_at(until, queue.recv()).await {
            Ok(Some(item)) => items.push(item),
            // The window is over, or every handle is gone (stopping):
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

    /// Items handed over within the window are served together, at most
    /// `most` at once; one handed over after it waits for the next round;
    /// the last round comes once every handle is gone.
    #[tokio::test(start_paused = true)]
    async fn gathers_within_the_window() {
        let (tx, mut rx) = mpsc::channel(16);
        let window = Duration::from_millis(50);
        let sender = tokio::spawn(async move {
            for i in 0..3 {
                tx.send(i).await.unwrap();
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            for i in 3..8 {
                tx.send(i).await.unwrap();
            }
        });
        assert_eq!(gather(&mut rx, window, 4).await, Some(vec![0, 1, 2]));
        assert_eq!(
            gather(&mut rx, window, 4).await,
            Some(vec![3, 4, 5, 6]),
            "at most four"
        );
        sender.await.unwrap();
        assert_eq!(gather(&mut rx, window, 4).await, Some(vec![7]));
        assert_eq!(gather(&mut rx, window, 4).await, None);
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
