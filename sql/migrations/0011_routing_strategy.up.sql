-- Routing strategy per model group (issue 13, docs/routing.md
-- "Strategies"): the JSON of sluice.admin.v1.ModelGroupRouting, validated
-- by the admin API ('{}': the defaults by traffic class).
ALTER TABLE model_groups ADD COLUMN routing jsonb NOT NULL DEFAULT '{}';
