package admin

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// auditService implements AuditService.
type auditService struct{ *Server }

func (s *auditService) ListAuditEvents(ctx context.Context, req *connect.Request[adminv1.ListAuditEventsRequest]) (*connect.Response[adminv1.ListAuditEventsResponse], error) {
	p := principal(ctx)
	m := req.Msg
	t := tenant(ctx)
	target := tokenTarget(p.Scope, p.OrgID, p.TeamID, "the audit trail")
	if m.GetOrgId() != "" && t.OrgID != "" && m.GetOrgId() != t.OrgID {
		target = authz.OrgTarget(m.GetOrgId(), "the audit trail of org "+m.GetOrgId())
	}
	if err := authz.Check(ctx, p, authz.Read, target); err != nil {
		return nil, err
	}
	q := store.AuditQuery{Tenant: t, ObjectType: m.GetObjectType(), ObjectID: m.GetObjectId(), Action: m.GetAction()}
	if q.OrgID == "" {
		q.OrgID = m.GetOrgId()
	}
	c := &validator{}
	if m.StartTime != nil {
		if err := m.StartTime.CheckValid(); err != nil {
			c.add("start_time", "invalid timestamp")
		}
		st := m.StartTime.AsTime()
		q.Start = &st
	}
	if m.EndTime != nil {
		if err := m.EndTime.CheckValid(); err != nil {
			c.add("end_time", "invalid timestamp")
		}
		et := m.EndTime.AsTime()
		q.End = &et
	}
	limit, after, err := pageArgs(m.GetPageSize(), m.GetPageToken())
	if err != nil {
		return nil, err
	}
	if after != "" {
		if q.AfterSeq, err = strconv.ParseInt(after, 10, 64); err != nil {
			c.add("page_token", "not a token from a previous page")
		}
	}
	if err := c.err(); err != nil {
		return nil, err
	}
	rows, err := s.store.AuditList(ctx, q, limit)
	if err != nil {
		return nil, err
	}
	resp := &adminv1.ListAuditEventsResponse{}
	for _, r := range rows {
		resp.Events = append(resp.Events, &adminv1.AuditEvent{
			Seq: r.Seq, Time: timestamppb.New(r.At), Actor: r.Actor, TokenId: r.TokenID, Action: r.Action,
			ObjectType: r.ObjectType, ObjectId: r.ObjectID, OrgId: r.OrgID, TeamId: r.TeamID, RequestId: r.RequestID,
			BeforeJson: r.BeforeJSON, AfterJson: r.AfterJSON, PrevHash: r.PrevHash, Hash: r.Hash,
		})
	}
	if len(rows) > 0 {
		resp.NextPageToken = nextPageToken(len(rows), limit, strconv.FormatInt(rows[len(rows)-1].Seq, 10))
	}
	return connect.NewResponse(resp), nil
}

// Verification bounds: one call checks at most maxVerifyPageSize records
// (a few seconds of database reads and hashing at most), and a replica
// runs at most maxConcurrentVerifications at once, so verifying cannot
// starve the admin API whatever the size of the chain.
const (
	defaultVerifyPageSize      = 10000
	maxVerifyPageSize          = 50000
	maxConcurrentVerifications = 2
)

// VerifyAuditChain verifies one page of the chain: the whole chain for
// platform tokens, the tenant's own records for org and team tokens (see
// the proto for what each view checks).
func (s *auditService) VerifyAuditChain(ctx context.Context, req *connect.Request[adminv1.VerifyAuditChainRequest]) (*connect.Response[adminv1.VerifyAuditChainResponse], error) {
	p := principal(ctx)
	if err := authz.Check(ctx, p, authz.Read, tokenTarget(p.Scope, p.OrgID, p.TeamID, "the audit trail")); err != nil {
		return nil, err
	}
	m := req.Msg
	c := &validator{}
	limit := defaultVerifyPageSize
	switch {
	case m.GetPageSize() < 0:
		c.add("page_size", "must not be negative")
	case m.GetPageSize() > maxVerifyPageSize:
		c.add("page_size", "must be at most %d (got %d)", maxVerifyPageSize, m.GetPageSize())
	case m.GetPageSize() > 0:
		limit = int(m.GetPageSize())
	}
	platform := p.Scope == authz.ScopePlatform
	var after store.VerifyCursor
	var tafter store.TenantCursor
	if tok := m.GetPageToken(); tok != "" {
		var ok bool
		if platform {
			after, ok = parsePlatformCursor(tok)
		} else {
			tafter, ok = parseTenantCursor(tok)
		}
		if !ok {
			c.add("page_token", "not a token from a previous page of this verification")
		}
	}
	if err := c.err(); err != nil {
		return nil, err
	}
	select {
	case s.verifySlots <- struct{}{}:
		defer func() { <-s.verifySlots }()
	default:
		return nil, connect.NewError(connect.CodeResourceExhausted, fmt.Errorf(
			"%d audit verifications are already running on this replica (the limit); retry shortly", maxConcurrentVerifications))
	}
	out := &adminv1.VerifyAuditChainResponse{}
	var brk *audit.Break
	if platform {
		res, err := s.store.AuditVerify(ctx, after, limit)
		if err != nil {
			return nil, err
		}
		out.Checked, brk = res.Checked, res.Break
		if res.Next != nil {
			out.NextPageToken = platformCursor(*res.Next)
		}
	} else {
		res, err := s.store.AuditVerifyTenant(ctx, tenant(ctx), tafter, limit)
		if err != nil {
			return nil, err
		}
		out.Checked, brk = res.Checked, res.Break
		if res.Next != nil {
			out.NextPageToken = tenantCursor(*res.Next)
		}
	}
	out.Ok = brk == nil
	if brk != nil {
		out.BrokenSeq, out.Problem = brk.Seq, brk.Problem
	}
	return connect.NewResponse(out), nil
}

// Page tokens of VerifyAuditChain: "p:<seq>:<hash hex>" (platform: the
// last record checked and its hash, which the next record must link to)
// and "t:<unix µs>:<seq>" (tenant: the last own record checked), base64.
func platformCursor(c store.VerifyCursor) string {
	return base64.RawURLEncoding.EncodeToString(fmt.Appendf(nil, "p:%d:%x", c.Seq, c.Hash))
}

func parsePlatformCursor(tok string) (store.VerifyCursor, bool) {
	parts, ok := cursorParts(tok, "p")
	if !ok {
		return store.VerifyCursor{}, false
	}
	seq, err := strconv.ParseInt(parts[0], 10, 64)
	hash, herr := hex.DecodeString(parts[1])
	if err != nil || herr != nil || seq <= 0 || len(hash) != sha256.Size {
		return store.VerifyCursor{}, false
	}
	return store.VerifyCursor{Seq: seq, Hash: hash}, true
}

func tenantCursor(c store.TenantCursor) string {
	return base64.RawURLEncoding.EncodeToString(fmt.Appendf(nil, "t:%d:%d", c.At.UnixMicro(), c.Seq))
}

func parseTenantCursor(tok string) (store.TenantCursor, bool) {
	parts, ok := cursorParts(tok, "t")
	if !ok {
		return store.TenantCursor{}, false
	}
	at, err := strconv.ParseInt(parts[0], 10, 64)
	seq, serr := strconv.ParseInt(parts[1], 10, 64)
	if err != nil || serr != nil || seq <= 0 {
		return store.TenantCursor{}, false
	}
	return store.TenantCursor{At: time.UnixMicro(at).UTC(), Seq: seq}, true
}

func cursorParts(tok, kind string) ([]string, bool) {
	if len(tok) > 200 {
		return nil, false
	}
	b, err := base64.RawURLEncoding.DecodeString(tok)
	if err != nil {
		return nil, false
	}
	parts := strings.Split(string(b), ":")
	if len(parts) != 3 || parts[0] != kind {
		return nil, false
	}
	return parts[1:], true
}
