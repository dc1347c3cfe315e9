DROP TABLE IF EXISTS spend_daily;
DROP TABLE IF EXISTS spend_logs;
DROP TABLE IF EXISTS deployments;
DROP TABLE IF EXISTS model_groups;
