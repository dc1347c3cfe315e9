DELETE FROM spend_daily WHERE scope = 'project';
DROP TABLE IF EXISTS label_scopes;
