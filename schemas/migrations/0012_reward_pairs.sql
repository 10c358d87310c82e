-- Two reward versions over the same trajectories (issue 15: rtrl rewards compare A B), one row per closed
-- trajectory of the trajectories table, whether or not either version scored it:
--   SELECT * FROM rtrl.reward_pairs(a = 'v1-discard-broken', b = 'v2')
-- scored_a / scored_b say whether the version has a reward for it (a version that discards a trajectory, as
-- v1-discard-broken does one with a broken tool call, has none); reward_a / reward_b are NULL then. Both sides
-- read FINAL, so a revised reward (a late event) counts with its final value, once.
CREATE VIEW IF NOT EXISTS {db}.reward_pairs AS
SELECT
    t.trajectory_id AS trajectory_id,
    t.policy_version AS policy_version,
    toString(t.org_id) AS org_id,
    toString(t.task_kind) AS task_kind,
    t.first_event_ts AS first_event_ts,
    t.broken_tool_calls AS broken_tool_calls,
    t.clarifying_questions AS clarifying_questions,
    ra.scored AS scored_a,
    if(ra.scored = 1, ra.reward, NULL) AS reward_a,
    ra.flags AS flags_a,
    rb.scored AS scored_b,
    if(rb.scored = 1, rb.reward, NULL) AS reward_b,
    rb.flags AS flags_b
FROM (SELECT * FROM {db}.trajectories FINAL) AS t
LEFT JOIN
(
    SELECT trajectory_id, toUInt8(1) AS scored, reward, flags
    FROM {db}.rewards FINAL
    WHERE reward_version = {a:String}
) AS ra ON ra.trajectory_id = t.trajectory_id
LEFT JOIN
(
    SELECT trajectory_id, toUInt8(1) AS scored, reward, flags
    FROM {db}.rewards FINAL
    WHERE reward_version = {b:String}
) AS rb ON rb.trajectory_id = t.trajectory_id;
