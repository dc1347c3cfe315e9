ALTER TABLE model_groups DROP COLUMN traffic;
ALTER TABLE deployments DROP COLUMN traffic;
ALTER TABLE orgs DROP COLUMN traffic;
