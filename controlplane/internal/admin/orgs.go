package admin

import (
	"context"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/events"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/ids"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// orgService implements OrgService.
type orgService struct{ *Server }

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
	out, err := createObject(ctx, s.store, orgObjects, &o, func(tx *store.Tx) error { return tx.OrgInsert(ctx, &o) })
	return reply(&adminv1.CreateOrgResponse{Org: out}, err)
}

func (s *orgService) GetOrg(ctx context.Context, req *connect.Request[adminv1.GetOrgRequest]) (*connect.Response[adminv1.GetOrgResponse], error) {
	out, err := getObject(ctx, s.store, orgObjects, req.Msg.GetId())
	return reply(&adminv1.GetOrgResponse{Org: out}, err)
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
	resp.Orgs, resp.NextPageToken, err = page(rows, limit, orgToProto, func(o store.Org) string { return o.ID })
	return reply(resp, err)
}

func (s *orgService) UpdateOrg(ctx context.Context, req *connect.Request[adminv1.UpdateOrgRequest]) (*connect.Response[adminv1.UpdateOrgResponse], error) {
	src, mask := req.Msg.GetOrg(), req.Msg.GetUpdateMask()
	// Changing an org's limits takes a platform admin, checked once the
	// org is found and the caller may edit it.
	b := orgObjects
	b.lock = func(ctx context.Context, tx *store.Tx, id string, op events.Op) (store.Org, error) {
		cur, err := orgObjects.lock(ctx, tx, id, op)
		if err != nil {
			return cur, err
		}
		return cur, checkOrgLimitsMask(ctx, mask)
	}
	out, err := updateObject(ctx, s.store, b, src.GetId(), src, mask, []string{"name", "limits", "metadata"},
		func(tx *store.Tx, cur *store.Org, _, after *adminv1.Org) error {
			if err := validateOrg(after); err != nil {
				return err
			}
			cur.Name, cur.Limits, cur.Metadata = after.Name, limitsJSON(after.Limits), after.Metadata
			return tx.OrgUpdate(ctx, cur)
		})
	return reply(&adminv1.UpdateOrgResponse{Org: out}, err)
}

func (s *orgService) DeleteOrg(ctx context.Context, req *connect.Request[adminv1.DeleteOrgRequest]) (*connect.Response[adminv1.DeleteOrgResponse], error) {
	return reply(&adminv1.DeleteOrgResponse{}, deleteObject(ctx, s.store, orgObjects, req.Msg.GetId()))
}

// orgObjects is the object of Create/Update/Block/Unblock/DeleteOrg: org
// editors update an org, only platform admins block or delete one.
var orgObjects = mutable[store.Org, *adminv1.Org]{
	object: events.ObjOrg,
	get:    (*store.Store).OrgGet,
	target: func(o store.Org) authz.Target { return authz.OrgTarget(o.ID, "org "+o.ID) },
	lock: func(ctx context.Context, tx *store.Tx, id string, op events.Op) (store.Org, error) {
		cur, err := tx.OrgGetForUpdate(ctx, tenant(ctx), id)
		if err != nil {
			return cur, err
		}
		target := authz.PlatformTarget("blocking or unblocking an org")
		switch op {
		case events.OpUpsert:
			target = authz.OrgTarget(cur.ID, "org "+cur.ID)
		case events.OpDelete:
			target = authz.PlatformTarget("deleting an org")
		}
		return cur, authz.Check(ctx, principal(ctx), authz.Write, target)
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

func (s *orgService) BlockOrg(ctx context.Context, req *connect.Request[adminv1.BlockOrgRequest]) (*connect.Response[adminv1.BlockOrgResponse], error) {
	o, err := setBlocked(ctx, s.store, orgObjects, req.Msg.GetId(), true)
	return reply(&adminv1.BlockOrgResponse{Org: o}, err)
}

func (s *orgService) UnblockOrg(ctx context.Context, req *connect.Request[adminv1.UnblockOrgRequest]) (*connect.Response[adminv1.UnblockOrgResponse], error) {
	o, err := setBlocked(ctx, s.store, orgObjects, req.Msg.GetId(), false)
	return reply(&adminv1.UnblockOrgResponse{Org: o}, err)
}
