//! Group commit's one shared step: take a batch of requests from a channel.

use crossbeam_channel::Receiver;

/// Blocks for one item, then takes whatever else is already queued, up to `max`: the requests
/// that arrived during the previous transaction share the next one (group commit). `None` when
/// every sender is gone.
pub fn recv_batch<T>(rx: &Receiver<T>, max: usize) -> Option<Vec<T>> {
    let first = rx.recv().ok()?;
    let mut batch = vec![first];
    while batch.len() < max {
        match rx.try_recv() {
            Ok(r) => batch.push(r),
            Err(_) => break,
        }
    }
    Some(batch)
}
