-- Traffic classes (SPEC §1, §7.2): an org's default class, classification
-- rules and demotion thresholds; a deployment's reserve, caps, engine
-- priority and queue overrides; a model group's queue overrides. Each is
-- the JSON of its sluice.admin.v1 message (OrgTraffic, DeploymentTraffic,
-- ModelGroupTraffic), validated by the admin API; '{}' is "nothing set".
ALTER TABLE orgs ADD COLUMN traffic jsonb NOT NULL DEFAULT '{}';
ALTER TABLE deployments ADD COLUMN traffic jsonb NOT NULL DEFAULT '{}';
ALTER TABLE model_groups ADD COLUMN traffic jsonb NOT NULL DEFAULT '{}';
