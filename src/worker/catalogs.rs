//! The catalogs of the runs in flight, as this process calls them: one resolved copy
//! ([`Config::catalog_for`]) per stored catalog, shared by every run of it. Ten thousand tasks
//! waiting on their model hold one, not ten thousand (the stored catalogs are shared the same
//! way as they are read: `store::rows::shared_catalog`).

use std::sync::{Arc, Mutex, PoisonError, Weak};

use crate::config::{Config, Resolved};
use crate::kernel::Catalog;

/// The resolved catalogs runs hold, each by the stored catalog it came from (`None`: the demo
/// shop's tools). An entry lives while a run holds its resolved catalog.
#[derive(Default)]
pub struct Catalogs(Mutex<Vec<Entry>>);

struct Entry {
    /// The stored catalog (its allocation: its address is not reused while this lives).
    stored: Option<Weak<Catalog>>,
    resolved: Weak<Resolved>,
}

impl Entry {
    fn of(&self, stored: Option<&Arc<Catalog>>) -> bool {
        match (&self.stored, stored) {
            (None, None) => true,
            (Some(w), Some(s)) => std::ptr::eq(w.as_ptr(), Arc::as_ptr(s)),
            _ => false,
        }
    }
}

impl Catalogs {
    /// `stored` as `config` calls it: the copy a run already holds, or a new one.
    pub fn resolve(&self, config: &Config, stored: Option<&Arc<Catalog>>) -> Arc<Resolved> {
        let mut held = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(r) = held
            .iter()
            .find(|e| e.of(stored))
            .and_then(|e| e.resolved.upgrade())
        {
            return r;
        }
        let r = Arc::new(config.catalog_for(stored.map(|c| &**c)));
        held.retain(|e| e.resolved.strong_count() > 0 && !e.of(stored));
        held.push(Entry {
            stored: stored.map(Arc::downgrade),
            resolved: Arc::downgrade(&r),
        });
        r
    }

    /// How many resolved catalogs runs hold now.
    pub fn held(&self) -> usize {
        let held = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        held.iter()
            .filter(|e| e.resolved.strong_count() > 0)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> Arc<Catalog> {
        Arc::new(Config::default().demo_catalog())
    }

    #[test]
    fn runs_of_one_stored_catalog_share_one_resolved_copy() {
        let (config, cache) = (Config::default(), Catalogs::default());
        let a = stored();
        let first = cache.resolve(&config, Some(&a));
        let second = cache.resolve(&config, Some(&a));
        assert!(
            Arc::ptr_eq(&first, &second),
            "one copy for one stored catalog"
        );
        let other = stored();
        let third = cache.resolve(&config, Some(&other));
        assert!(
            !Arc::ptr_eq(&first, &third),
            "another stored catalog, another copy"
        );
        let demo = cache.resolve(&config, None);
        assert!(Arc::ptr_eq(&demo, &cache.resolve(&config, None)));
        assert_eq!(cache.held(), 3);
        drop((first, second, third, demo));
        assert_eq!(cache.held(), 0, "a copy no run holds is not kept");
        // Resolved again once no run holds it.
        let again = cache.resolve(&config, Some(&a));
        assert_eq!(
            again.catalog,
            Config::default().catalog_for(Some(&a)).catalog
        );
    }
}
