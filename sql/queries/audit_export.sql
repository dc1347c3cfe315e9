-- Audit export position (see controlplane/internal/auditexport).

-- name: AuditExportPosition :one
SELECT published_seq FROM audit_export WHERE id = 1;

-- name: AuditExportAdvance :exec
UPDATE audit_export SET published_seq = @published_seq WHERE id = 1 AND published_seq < @published_seq;
