-- Traffic-class settings (SPEC §1, §7.2), stored as JSON of the admin
-- messages on their owners' rows. Reads go through the owners' queries.

-- name: OrgTrafficSet :exec
UPDATE orgs SET traffic = @traffic, updated_at = @updated_at WHERE id = @id;

-- name: DeploymentTrafficSet :exec
UPDATE deployments SET traffic = @traffic, updated_at = @updated_at WHERE id = @id;

-- name: ModelGroupTrafficSet :exec
UPDATE model_groups SET traffic = @traffic, updated_at = @updated_at WHERE name = @name;
