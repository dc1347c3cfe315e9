package store

import (
	"context"
	"fmt"
	"time"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// AuditQuery filters AuditList.
type AuditQuery struct {
	Tenant
	ObjectType string
	ObjectID   string
	Action     string
	Start, End *time.Time
	AfterSeq   int64
}

func auditFromRow(r dbsqlc.AuditLog) audit.Record {
	return audit.Record{
		Seq: r.Seq, At: r.At.UTC(), Actor: r.Actor, TokenID: r.TokenID, Action: r.Action, ObjectType: r.ObjectType,
		ObjectID: r.ObjectID, OrgID: r.OrgID, TeamID: r.TeamID, RequestID: r.RequestID,
		BeforeJSON: r.BeforeJson, AfterJSON: r.AfterJson, PrevHash: r.PrevHash, Hash: r.Hash,
	}
}

// AuditList returns audit records in chain order.
func (s *Store) AuditList(ctx context.Context, q AuditQuery, limit int) ([]audit.Record, error) {
	rows, err := s.q.AuditList(ctx, s.pool, dbsqlc.AuditListParams{
		AfterSeq: q.AfterSeq, OrgID: optStr(q.OrgID), TeamID: optStr(q.TeamID), ObjectType: optStr(q.ObjectType),
		ObjectID: optStr(q.ObjectID), Action: optStr(q.Action), StartAt: q.Start, EndAt: q.End, Lim: int32(limit),
	})
	if err != nil {
		return nil, fmt.Errorf("list audit records: %w", err)
	}
	out := make([]audit.Record, len(rows))
	for i, r := range rows {
		out[i] = auditFromRow(r)
	}
	return out, nil
}

// VerifyResult is the outcome of AuditVerify.
type VerifyResult struct {
	Checked int64
	Break   *audit.Break
}

// AuditVerify walks the whole chain in sequence order and checks every
// link and the chain head. The head is read first in the same snapshot
// (repeatable read), so concurrent appends do not cause false alarms.
func (s *Store) AuditVerify(ctx context.Context) (VerifyResult, error) {
	tx, err := s.pool.BeginTx(ctx, pgxRepeatableReadRO)
	if err != nil {
		return VerifyResult{}, fmt.Errorf("begin verify: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	head, err := s.q.ChainHeadGet(ctx, tx)
	if err != nil {
		return VerifyResult{}, fmt.Errorf("read chain head: %w", err)
	}
	v := audit.NewVerifier()
	var after int64
	for {
		rows, err := s.q.AuditScan(ctx, tx, dbsqlc.AuditScanParams{AfterSeq: after, Lim: 1000})
		if err != nil {
			return VerifyResult{}, fmt.Errorf("scan audit records: %w", err)
		}
		for _, r := range rows {
			rec := auditFromRow(r)
			if b := v.Next(&rec); b != nil {
				return VerifyResult{Checked: v.Checked(), Break: b}, nil
			}
			after = r.Seq
		}
		if len(rows) < 1000 {
			break
		}
	}
	return VerifyResult{Checked: v.Checked(), Break: v.End(head.AuditSeq, head.AuditHash)}, nil
}
