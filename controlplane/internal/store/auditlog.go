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

// VerifyResult is the outcome of one page of AuditVerify.
type VerifyResult struct {
	// Checked counts the records verified in this page.
	Checked int64
	// Break is the first broken link, nil if none.
	Break *audit.Break
	// Next is where the next page starts; nil when the verification is
	// complete (or broken).
	Next *VerifyCursor
}

// VerifyCursor is the last record a platform verification page checked.
type VerifyCursor struct {
	Seq  int64
	Hash []byte
}

// verifyBatch is how many records one query reads.
const verifyBatch = 1000

// AuditVerify checks up to limit records of the chain after cursor
// (zero: from the first record), in sequence order: every link and every
// hash, and once the page reaches the end, the chain head too. It runs in
// one repeatable-read snapshot, the head read first, so concurrent
// appends do not cause false alarms.
func (s *Store) AuditVerify(ctx context.Context, after VerifyCursor, limit int) (VerifyResult, error) {
	tx, err := s.pool.BeginTx(ctx, pgxRepeatableReadRO)
	if err != nil {
		return VerifyResult{}, fmt.Errorf("begin verify: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	head, err := s.q.ChainHeadGet(ctx, tx)
	if err != nil {
		return VerifyResult{}, fmt.Errorf("read chain head: %w", err)
	}
	v := audit.ResumeVerifier(after.Seq, after.Hash)
	cur := after.Seq
	for int(v.Checked()) < limit {
		n := min(verifyBatch, limit-int(v.Checked()))
		rows, err := s.q.AuditScan(ctx, tx, dbsqlc.AuditScanParams{AfterSeq: cur, Lim: int32(n)})
		if err != nil {
			return VerifyResult{}, fmt.Errorf("scan audit records: %w", err)
		}
		for _, r := range rows {
			rec := auditFromRow(r)
			if b := v.Next(&rec); b != nil {
				return VerifyResult{Checked: v.Checked(), Break: b}, nil
			}
			cur = r.Seq
		}
		if len(rows) < n {
			return VerifyResult{Checked: v.Checked(), Break: v.End(head.AuditSeq, head.AuditHash)}, nil
		}
	}
	if seq, hash := v.Position(); seq < head.AuditSeq {
		return VerifyResult{Checked: v.Checked(), Next: &VerifyCursor{Seq: seq, Hash: hash}}, nil
	}
	return VerifyResult{Checked: v.Checked(), Break: v.End(head.AuditSeq, head.AuditHash)}, nil
}

// TenantCursor is the last record a tenant verification page checked, in
// the (at, seq) order of the tenant's index.
type TenantCursor struct {
	At  time.Time
	Seq int64
}

// TenantVerifyResult is the outcome of one page of AuditVerifyTenant.
type TenantVerifyResult struct {
	Checked int64
	Break   *audit.Break
	// Next is where the next page starts; nil when none remains.
	Next *TenantCursor
}

// AuditVerifyTenant checks up to limit of tenant t's records (t.OrgID
// required; t.TeamID narrows to a team) after cursor, each on its own
// (audit.CheckAlone): its hash, and its link to the record before it in
// the chain, compared by hash only. The records of other tenants are
// neither returned nor counted.
func (s *Store) AuditVerifyTenant(ctx context.Context, t Tenant, after TenantCursor, limit int) (TenantVerifyResult, error) {
	tx, err := s.pool.BeginTx(ctx, pgxRepeatableReadRO)
	if err != nil {
		return TenantVerifyResult{}, fmt.Errorf("begin verify: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var out TenantVerifyResult
	cur := after
	for int(out.Checked) < limit {
		n := min(verifyBatch, limit-int(out.Checked))
		rows, err := s.q.AuditScanTenant(ctx, tx, dbsqlc.AuditScanTenantParams{
			OrgID: t.OrgID, TeamID: optStr(t.TeamID), AfterAt: cur.At, AfterSeq: cur.Seq, Lim: int32(n),
		})
		if err != nil {
			return TenantVerifyResult{}, fmt.Errorf("scan audit records: %w", err)
		}
		for _, r := range rows {
			rec := auditFromRow(r.AuditLog)
			if b := audit.CheckAlone(&rec, r.PredHash); b != nil {
				out.Break = b
				return out, nil
			}
			out.Checked++
			cur = TenantCursor{At: r.AuditLog.At, Seq: r.AuditLog.Seq}
		}
		if len(rows) < n {
			return out, nil
		}
	}
	out.Next = &cur
	return out, nil
}
