-- Audit export (SPEC §5): every audit record is published, in chain
-- order and exactly once, to the JetStream stream SLUICE_AUDIT. This row
-- is the export's position: the sequence of the last record the stream
-- acknowledged. The publisher advances it after each acknowledgement;
-- a crash between the two republishes the record with the same message
-- id (its sequence), which JetStream's duplicate window drops, and the
-- publisher also checks the stream's last message before publishing.
CREATE TABLE audit_export (
    id             integer PRIMARY KEY CHECK (id = 1),
    published_seq  bigint NOT NULL CHECK (published_seq >= 0)
);
INSERT INTO audit_export (id, published_seq) VALUES (1, 0);

-- Wakes the exporter when a record commits (notifications are delivered
-- at commit).
CREATE FUNCTION audit_log_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('sluice_audit', NEW.seq::text);
    RETURN NEW;
END;
$$;
CREATE TRIGGER audit_log_notify AFTER INSERT ON audit_log
    FOR EACH ROW EXECUTE FUNCTION audit_log_notify();
