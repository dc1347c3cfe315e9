-- Fallback model groups and per-group resilience settings (SPEC §7.3,
-- docs/resilience.md). A model group's ordered fallbacks and the JSON of
-- its sluice.admin.v1.ModelGroupResilience ('{}': the proxy's flags);
-- keys' and teams' per-group overrides as JSON {"<group>": ["<fallback>", ...]}
-- ('{}': none). Names are validated by the admin API (they exist, no
-- self-reference, no cycle); the data plane skips one that disappeared.
ALTER TABLE model_groups ADD COLUMN fallbacks text[] NOT NULL DEFAULT '{}';
ALTER TABLE model_groups ADD COLUMN resilience jsonb NOT NULL DEFAULT '{}';
ALTER TABLE keys ADD COLUMN fallbacks jsonb NOT NULL DEFAULT '{}';
ALTER TABLE teams ADD COLUMN fallbacks jsonb NOT NULL DEFAULT '{}';
-- The fleet view: deployments each data plane keeps out of rotation, as of
-- its latest heartbeat (JSON list of {deployment_id, model_group, reason, until}).
ALTER TABLE data_planes ADD COLUMN ejected jsonb NOT NULL DEFAULT '[]';
