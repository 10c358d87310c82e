-- Users, roles, grants, settings profiles and a quota for rtrl on a ClickHouse server.
--
-- Run once as an administrator (clickhouse-client --multiquery < security.sql) after replacing the
-- two CHANGE_ME passwords, and the database name `rtrl` if clickhouse.database is another. Then:
--   flows, trainer, `rtrl run`:  clickhouse.dsn = https://rtrl_writer@HOST:8443/
--                                clickhouse.password_file = a file holding the writer's password
--   analysts:                    user rtrl_analyst (read-only, SELECT on the tables below only)
-- The embedded front (devservices/chserver/) applies the same split to its two users
-- (rtrl_writer, rtrl_analyst); tests/test_chserver_security.py checks that this file parses on the
-- engine and that its analyst grants are the front's (rtrl.clickhouse.ANALYST_TABLES).

-- Settings profiles: bounds on every query of each user.
-- insert_distributed_sync: on a cluster (clickhouse.cluster) an insert into a Distributed table returns once the
-- rows are stored on their shards, not queued on the node the writer talks to: a flow's snapshot after a flush then
-- means the rows are in the replicated tables (no effect on one node, where nothing is Distributed).
CREATE SETTINGS PROFILE IF NOT EXISTS rtrl_writer_profile
    SETTINGS max_execution_time = 600, max_memory_usage = 20000000000, insert_distributed_sync = 1;
CREATE SETTINGS PROFILE IF NOT EXISTS rtrl_analyst_profile
    SETTINGS readonly = 1, max_execution_time = 60, max_memory_usage = 10000000000, max_result_rows = 10000000;

-- The writer: the reward and batch flows, the trainer, migrations (CREATE/ALTER), replays (DELETE).
CREATE ROLE IF NOT EXISTS rtrl_writer_role;
GRANT CREATE DATABASE ON rtrl.* TO rtrl_writer_role;
GRANT SELECT, INSERT, ALTER, CREATE TABLE, CREATE VIEW, DROP VIEW, OPTIMIZE, TRUNCATE ON rtrl.* TO rtrl_writer_role;
-- The erasure audit is append-only (rtrl.clickhouse.APPEND_ONLY_TABLES): `rtrl erase` inserts its rows and no
-- one with the writer role may alter, delete from or truncate them (a partial revoke of the grant above).
REVOKE ALTER, TRUNCATE ON rtrl.erasures FROM rtrl_writer_role;
-- on a cluster (clickhouse.cluster) the rows live in the per-node table under the Distributed one
REVOKE ALTER, TRUNCATE ON rtrl.erasures_local FROM rtrl_writer_role;

-- The analyst: read-only, SELECT on the monitors' views, the tables they read, and the tables of
-- outcomes and decisions; never the raw events, rollouts or training batches.
CREATE ROLE IF NOT EXISTS rtrl_analyst_role SETTINGS PROFILE 'rtrl_analyst_profile';
GRANT SELECT ON rtrl.behaviour TO rtrl_analyst_role;
GRANT SELECT ON rtrl.reward_stats TO rtrl_analyst_role;
GRANT SELECT ON rtrl.reward_pairs TO rtrl_analyst_role;
GRANT SELECT ON rtrl.user_behaviour TO rtrl_analyst_role;
GRANT SELECT ON rtrl.user_behaviour_between TO rtrl_analyst_role;
GRANT SELECT ON rtrl.user_rewards_between TO rtrl_analyst_role;
GRANT SELECT ON rtrl.trajectories TO rtrl_analyst_role;
GRANT SELECT ON rtrl.rewards TO rtrl_analyst_role;
GRANT SELECT ON rtrl.checkpoints TO rtrl_analyst_role;
GRANT SELECT ON rtrl.dead_letters TO rtrl_analyst_role;
GRANT SELECT ON rtrl.train_metrics TO rtrl_analyst_role;
GRANT SELECT ON rtrl.batch_stats TO rtrl_analyst_role;
GRANT SELECT ON rtrl.reward_versions TO rtrl_analyst_role;
GRANT SELECT ON rtrl.verdict_delays TO rtrl_analyst_role;
GRANT SELECT ON rtrl.reward_arrival TO rtrl_analyst_role;
GRANT SELECT ON rtrl.provisional_vs_final TO rtrl_analyst_role;
GRANT SELECT ON rtrl.provisional_rewards TO rtrl_analyst_role;
GRANT SELECT ON rtrl.promotions TO rtrl_analyst_role;
GRANT SELECT ON rtrl.adapter_checkpoints TO rtrl_analyst_role;
GRANT SELECT ON rtrl.erasures TO rtrl_analyst_role;
GRANT SELECT ON rtrl.secret_findings TO rtrl_analyst_role;

-- Users (passwords are placeholders: replace them; store the writer's in the password file).
CREATE USER IF NOT EXISTS rtrl_writer IDENTIFIED WITH sha256_password BY 'CHANGE_ME_WRITER_PASSWORD'
    DEFAULT DATABASE rtrl SETTINGS PROFILE 'rtrl_writer_profile';
GRANT rtrl_writer_role TO rtrl_writer;
CREATE USER IF NOT EXISTS rtrl_analyst IDENTIFIED WITH sha256_password BY 'CHANGE_ME_ANALYST_PASSWORD'
    DEFAULT DATABASE rtrl SETTINGS PROFILE 'rtrl_analyst_profile';
GRANT rtrl_analyst_role TO rtrl_analyst;

-- A quota: what the analysts may take per hour, together.
CREATE QUOTA IF NOT EXISTS rtrl_analyst_quota
    FOR INTERVAL 1 hour MAX queries = 1000, result_rows = 100000000, read_rows = 10000000000, execution_time = 3600
    TO rtrl_analyst_role;
