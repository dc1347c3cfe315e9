package admin

import (
	"context"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/events"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/ids"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// orgService implements OrgService.
type orgService struct{ *Server }

const objOrg = string(events.ObjOrg)

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
		return outbox(ctx, tx, events.OrgUpserted, o.ID, o.ID, nil)
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
		if err := checkOrgLimitsMask(ctx, req.Msg.GetUpdateMask()); err != nil {
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
		return outbox(ctx, tx, events.OrgUpserted, cur.ID, cur.ID, nil)
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.UpdateOrgResponse{Org: out}), nil
}

func (s *orgService) DeleteOrg(ctx context.Context, req *connect.Request[adminv1.DeleteOrgRequest]) (*connect.Response[adminv1.DeleteOrgResponse], error) {
	if err := deleteObject(ctx, s.store, orgObjects, req.Msg.GetId()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.DeleteOrgResponse{}), nil
}

// orgObjects is the object of Block/Unblock/DeleteOrg: only platform admins block or delete
// an org.
var orgObjects = mutable[store.Org, *adminv1.Org]{
	object: events.ObjOrg,
	lock: func(ctx context.Context, tx *store.Tx, id string, op events.Op) (store.Org, error) {
		cur, err := tx.OrgGetForUpdate(ctx, tenant(ctx), id)
		if err != nil {
			return cur, err
		}
		what := "blocking or unblocking an org"
		if op == events.OpDelete {
			what = "deleting an org"
		}
		return cur, authz.Check(ctx, principal(ctx), authz.Write, authz.PlatformTarget(what))
	},
	remove: func(ctx context.Context, tx *store.Tx, cur store.Org) (any, error) {
		return nil, tx.OrgDelete(ctx, cur.ID)
	},
	set: func(ctx context.Context, tx *store.Tx, cur *store.Org, b bool) error {
		return tx.OrgSetBlocked(ctx, cur, b)
	},
	toProto: orgToProto,
	scope:   func(o store.Org) (string, string, string) { return o.ID, o.ID, "" },
}

func (s *orgService) setBlocked(ctx context.Context, id string, blocked bool) (*adminv1.Org, error) {
	return setBlocked(ctx, s.store, orgObjects, id, blocked)
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
