package admin

import (
	"context"
	"strconv"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

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

func (s *auditService) VerifyAuditChain(ctx context.Context, _ *connect.Request[adminv1.VerifyAuditChainRequest]) (*connect.Response[adminv1.VerifyAuditChainResponse], error) {
	p := principal(ctx)
	if err := authz.Check(ctx, p, authz.Read, tokenTarget(p.Scope, p.OrgID, p.TeamID, "the audit trail")); err != nil {
		return nil, err
	}
	res, err := s.store.AuditVerify(ctx)
	if err != nil {
		return nil, err
	}
	out := &adminv1.VerifyAuditChainResponse{Ok: res.Break == nil, Checked: res.Checked}
	if res.Break != nil {
		out.BrokenSeq, out.Problem = res.Break.Seq, res.Break.Problem
	}
	return connect.NewResponse(out), nil
}
