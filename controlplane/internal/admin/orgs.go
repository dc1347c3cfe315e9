package admin

import (
	"context"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/ids"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// orgService implements OrgService.
type orgService struct{ *Server }

const objOrg = "org"

func orgToProto(o store.Org) (*adminv1.Org, error) {
	l, err := limitsFromJSON(o.Limits)
	if err != nil {
		return nil, err
	}
	return &adminv1.Org{
		Id: o.ID, Name: o.Name, Limits: l, Blocked: o.Blocked, Metadata: o.Metadata,
		CreateTime: timestamppb.New(o.CreatedAt), UpdateTime: timestamppb.New(o.UpdatedAt),
	}, nil
}

func validateOrg(o *adminv1.Org) error {
	c := &validator{}
	validateName(c, "name", o.GetName(), 100)
	validateLimits(c, "limits", o.GetLimits(), LevelOrg, nil)
	validateMetadata(c, o.GetMetadata())
	return c.err()
}

func orgEvent(kind, id string) store.OutboxEvent {
	return store.OutboxEvent{Kind: kind, OrgID: id, ObjectType: objOrg, ObjectID: id}
}

func (s *orgService) CreateOrg(ctx context.Context, req *connect.Request[adminv1.CreateOrgRequest]) (*connect.Response[adminv1.CreateOrgResponse], error) {
	if err := authz.Check(ctx, principal(ctx), authz.Write, authz.PlatformTarget("creating an org")); err != nil {
		return nil, err
	}
	m := req.Msg
	want := &adminv1.Org{Name: m.GetName(), Limits: m.GetLimits(), Metadata: m.GetMetadata()}
	if err := validateOrg(want); err != nil {
		return nil, err
	}
	o := store.Org{ID: ids.New(ids.Org), Name: want.Name, Limits: limitsJSON(want.Limits), Metadata: want.Metadata}
	var out *adminv1.Org
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		if err := tx.OrgInsert(ctx, &o); err != nil {
			return err
		}
		var err error
		if out, err = orgToProto(o); err != nil {
			return err
		}
		if err := tx.Audit(ctx, audit.ActionCreated, objOrg, o.ID, o.ID, "", nil, auditJSON(out)); err != nil {
			return err
		}
		return tx.Outbox(ctx, orgEvent(store.EventOrgUpserted, o.ID))
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.CreateOrgResponse{Org: out}), nil
}

func (s *orgService) GetOrg(ctx context.Context, req *connect.Request[adminv1.GetOrgRequest]) (*connect.Response[adminv1.GetOrgResponse], error) {
	o, err := s.store.OrgGet(ctx, tenant(ctx), req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	if err := authz.Check(ctx, principal(ctx), authz.Read, authz.OrgTarget(o.ID, "org "+o.ID)); err != nil {
		return nil, err
	}
	out, err := orgToProto(o)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.GetOrgResponse{Org: out}), nil
}

func (s *orgService) ListOrgs(ctx context.Context, req *connect.Request[adminv1.ListOrgsRequest]) (*connect.Response[adminv1.ListOrgsResponse], error) {
	p := principal(ctx)
	t := tenant(ctx)
	target := authz.PlatformTarget("listing orgs")
	if t.OrgID != "" {
		target = authz.OrgTarget(t.OrgID, "org "+t.OrgID)
		if p.Scope == authz.ScopeTeam {
			target = authz.TeamTarget(t.OrgID, t.TeamID, "org "+t.OrgID)
		}
	}
	if err := authz.Check(ctx, p, authz.Read, target); err != nil {
		return nil, err
	}
	limit, after, err := pageArgs(req.Msg.GetPageSize(), req.Msg.GetPageToken())
	if err != nil {
		return nil, err
	}
	rows, err := s.store.OrgList(ctx, t, store.OrgQuery{NamePrefix: req.Msg.GetNamePrefix(), Blocked: req.Msg.Blocked}, store.Page{After: after, Limit: limit})
	if err != nil {
		return nil, err
	}
	resp := &adminv1.ListOrgsResponse{}
	for _, r := range rows {
		o, err := orgToProto(r)
		if err != nil {
			return nil, err
		}
		resp.Orgs = append(resp.Orgs, o)
	}
	if len(rows) > 0 {
		resp.NextPageToken = nextPageToken(len(rows), limit, rows[len(rows)-1].ID)
	}
	return connect.NewResponse(resp), nil
}

func (s *orgService) UpdateOrg(ctx context.Context, req *connect.Request[adminv1.UpdateOrgRequest]) (*connect.Response[adminv1.UpdateOrgResponse], error) {
	id := req.Msg.GetOrg().GetId()
	var out *adminv1.Org
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := tx.OrgGetForUpdate(ctx, tenant(ctx), id)
		if err != nil {
			return err
		}
		if err := authz.Check(ctx, principal(ctx), authz.Write, authz.OrgTarget(cur.ID, "org "+cur.ID)); err != nil {
			return err
		}
		before, err := orgToProto(cur)
		if err != nil {
			return err
		}
		after := proto.Clone(before).(*adminv1.Org)
		if err := applyMask(after, req.Msg.GetOrg(), req.Msg.GetUpdateMask(), "name", "limits", "metadata"); err != nil {
			return err
		}
		if err := validateOrg(after); err != nil {
			return err
		}
		cur.Name, cur.Limits, cur.Metadata = after.Name, limitsJSON(after.Limits), after.Metadata
		if err := tx.OrgUpdate(ctx, &cur); err != nil {
			return err
		}
		after.UpdateTime = timestamppb.New(cur.UpdatedAt)
		out = after
		if err := tx.Audit(ctx, audit.ActionUpdated, objOrg, cur.ID, cur.ID, "", auditJSON(before), auditJSON(after)); err != nil {
			return err
		}
		return tx.Outbox(ctx, orgEvent(store.EventOrgUpserted, cur.ID))
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.UpdateOrgResponse{Org: out}), nil
}

func (s *orgService) DeleteOrg(ctx context.Context, req *connect.Request[adminv1.DeleteOrgRequest]) (*connect.Response[adminv1.DeleteOrgResponse], error) {
	id := req.Msg.GetId()
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := tx.OrgGetForUpdate(ctx, tenant(ctx), id)
		if err != nil {
			return err
		}
		if err := authz.Check(ctx, principal(ctx), authz.Write, authz.PlatformTarget("deleting an org")); err != nil {
			return err
		}
		before, err := orgToProto(cur)
		if err != nil {
			return err
		}
		if err := tx.OrgDelete(ctx, cur.ID); err != nil {
			return err
		}
		if err := tx.Audit(ctx, audit.ActionDeleted, objOrg, cur.ID, cur.ID, "", auditJSON(before), nil); err != nil {
			return err
		}
		return tx.Outbox(ctx, orgEvent(store.EventOrgDeleted, cur.ID))
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.DeleteOrgResponse{}), nil
}

func (s *orgService) setBlocked(ctx context.Context, id string, blocked bool) (*adminv1.Org, error) {
	action, kind := audit.ActionBlocked, store.EventOrgBlocked
	if !blocked {
		action, kind = audit.ActionUnblocked, store.EventOrgUnblocked
	}
	var out *adminv1.Org
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := tx.OrgGetForUpdate(ctx, tenant(ctx), id)
		if err != nil {
			return err
		}
		if err := authz.Check(ctx, principal(ctx), authz.Write, authz.PlatformTarget("blocking or unblocking an org")); err != nil {
			return err
		}
		before, err := orgToProto(cur)
		if err != nil {
			return err
		}
		if err := tx.OrgSetBlocked(ctx, &cur, blocked); err != nil {
			return err
		}
		if out, err = orgToProto(cur); err != nil {
			return err
		}
		if err := tx.Audit(ctx, action, objOrg, cur.ID, cur.ID, "", auditJSON(before), auditJSON(out)); err != nil {
			return err
		}
		return tx.Outbox(ctx, orgEvent(kind, cur.ID))
	})
	return out, err
}

func (s *orgService) BlockOrg(ctx context.Context, req *connect.Request[adminv1.BlockOrgRequest]) (*connect.Response[adminv1.BlockOrgResponse], error) {
	o, err := s.setBlocked(ctx, req.Msg.GetId(), true)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.BlockOrgResponse{Org: o}), nil
}

func (s *orgService) UnblockOrg(ctx context.Context, req *connect.Request[adminv1.UnblockOrgRequest]) (*connect.Response[adminv1.UnblockOrgResponse], error) {
	o, err := s.setBlocked(ctx, req.Msg.GetId(), false)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.UnblockOrgResponse{Org: o}), nil
}
