package admin

import (
	"context"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/events"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// Grants of model groups to orgs (docs/tenancy.md). Granting and revoking
// are platform decisions (writeModels); every change is audited as the
// object model_group_grant "<group>/<org>" and distributed as the model
// group with its grants as they are now (model_group.granted, and
// model_group.revoked, a security event).

const objGrant = "model_group_grant"

func grantToProto(g store.ModelGroupGrant) *adminv1.ModelGroupGrant {
	return &adminv1.ModelGroupGrant{ModelGroup: g.ModelGroup, OrgId: g.OrgID, CreateTime: timestamppb.New(g.CreatedAt), CreatedBy: g.CreatedBy}
}

func validateGrantRef(group, org string) error {
	c := &validator{}
	if group == "" {
		c.add("model_group", "required")
	} else {
		validModelGroupName(c, "model_group", group)
	}
	if org == "" {
		c.add("org_id", "required")
	}
	return c.err()
}

func (s *modelService) GrantModelGroup(ctx context.Context, req *connect.Request[adminv1.GrantModelGroupRequest]) (*connect.Response[adminv1.GrantModelGroupResponse], error) {
	if err := writeModels(ctx); err != nil {
		return nil, err
	}
	group, org := req.Msg.GetModelGroup(), req.Msg.GetOrgId()
	if err := validateGrantRef(group, org); err != nil {
		return nil, err
	}
	var out *adminv1.ModelGroupGrant
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		if _, err := tx.ModelGroupGetForUpdate(ctx, group); err != nil {
			return err
		}
		if _, err := tx.OrgGetForUpdate(ctx, store.Tenant{}, org); err != nil {
			return err
		}
		g := store.ModelGroupGrant{ModelGroup: group, OrgID: org, CreatedBy: principal(ctx).ID}
		if err := tx.ModelGroupGrantInsert(ctx, &g); err != nil {
			return err
		}
		out = grantToProto(g)
		if err := tx.Audit(ctx, audit.ActionGranted, objGrant, group+"/"+org, org, "", nil, auditJSON(out)); err != nil {
			return err
		}
		return outbox(ctx, tx, events.ModelGroupGranted, "", group, nil)
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.GrantModelGroupResponse{Grant: out}), nil
}

func (s *modelService) RevokeModelGroup(ctx context.Context, req *connect.Request[adminv1.RevokeModelGroupRequest]) (*connect.Response[adminv1.RevokeModelGroupResponse], error) {
	if err := writeModels(ctx); err != nil {
		return nil, err
	}
	group, org := req.Msg.GetModelGroup(), req.Msg.GetOrgId()
	if err := validateGrantRef(group, org); err != nil {
		return nil, err
	}
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		if _, err := tx.ModelGroupGetForUpdate(ctx, group); err != nil {
			return err
		}
		if err := tx.ModelGroupGrantDelete(ctx, group, org); err != nil {
			return err
		}
		before := &adminv1.ModelGroupGrant{ModelGroup: group, OrgId: org}
		if err := tx.Audit(ctx, audit.ActionRevoked, objGrant, group+"/"+org, org, "", auditJSON(before), nil); err != nil {
			return err
		}
		return outbox(ctx, tx, events.ModelGroupRevoked, "", group, nil)
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.RevokeModelGroupResponse{}), nil
}

// ListModelGroupGrants lists grants: platform tokens every grant, org and
// team tokens their own org's (naming another org is PermissionDenied).
func (s *modelService) ListModelGroupGrants(ctx context.Context, req *connect.Request[adminv1.ListModelGroupGrantsRequest]) (*connect.Response[adminv1.ListModelGroupGrantsResponse], error) {
	p := principal(ctx)
	m := req.Msg
	q := store.GrantQuery{ModelGroup: m.GetModelGroup(), OrgID: m.GetOrgId()}
	target := tokenTarget(p.Scope, p.OrgID, p.TeamID, "model group grants")
	if org := visibleOrg(ctx); org != "" {
		if q.OrgID != "" && q.OrgID != org {
			target = authz.OrgTarget(q.OrgID, "model group grants of org "+q.OrgID)
		}
		q.OrgID = org
	}
	if err := authz.Check(ctx, p, authz.Read, target); err != nil {
		return nil, err
	}
	limit, after, err := pageArgs(m.GetPageSize(), m.GetPageToken())
	if err != nil {
		return nil, err
	}
	afterGroup, afterOrg := "", ""
	if after != "" {
		var ok bool
		if afterGroup, afterOrg, ok = strings.Cut(after, "\x00"); !ok {
			return nil, invalid("page_token", "not a token from a previous page")
		}
	}
	rows, err := s.store.ModelGroupGrantList(ctx, q, afterGroup, afterOrg, limit)
	if err != nil {
		return nil, err
	}
	resp := &adminv1.ListModelGroupGrantsResponse{}
	for _, g := range rows {
		resp.Grants = append(resp.Grants, grantToProto(g))
	}
	if len(rows) > 0 {
		last := rows[len(rows)-1]
		resp.NextPageToken = nextPageToken(len(rows), limit, last.ModelGroup+"\x00"+last.OrgID)
	}
	return connect.NewResponse(resp), nil
}
