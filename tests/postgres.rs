//! The PostgreSQL harness the backend's tests stand on (issue 10): a throwaway cluster of the
//! test's own starts on a free port, keeps a committed row across a crash-like stop
//! (`pg_ctl stop -m immediate`) and a restart, and is gone when the test ends.

mod common;
use common::pg::PgCluster;

#[test]
fn a_throwaway_cluster_keeps_committed_rows_across_an_immediate_stop() {
    let Some(pg) = PgCluster::start("harness") else {
        return;
    };
    pg.psql("CREATE TABLE t (id int PRIMARY KEY, v text NOT NULL)");
    pg.psql("INSERT INTO t VALUES (1, 'committed')");
    pg.stop_immediate();
    let refused = std::process::Command::new("psql")
        .args(["-X", "-d", &pg.url(), "-c", "SELECT 1"])
        .output()
        .map(|o| o.status.success());
    assert_ne!(
        refused.ok(),
        Some(true),
        "the server is down after the stop"
    );
    pg.start_server();
    assert_eq!(pg.psql("SELECT v FROM t WHERE id = 1"), "committed");
    assert_eq!(pg.psql("SHOW server_version_num").len(), 6);
}
