package admin

import (
	"context"
	"unicode/utf8"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/events"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/ids"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// labelScopeService implements LabelScopeService: the project and tag
// scopes of an org (docs/limits.md, "Project and tag scopes"). They are
// org-level objects like end customers: org and platform tokens manage
// them, team tokens neither see nor change them (a team's keys share the
// org's projects and tags with other teams).
type labelScopeService struct{ *Server }

// labelScopeUpdatable lists the update_mask paths UpdateLabelScope
// accepts (nested "limits.<field>" paths included through "limits").
var labelScopeUpdatable = []string{"limits"}

// labelKinds pairs the stored kinds with the admin enum.
var labelKinds = enumPairs[string, adminv1.LabelScopeKind]{
	{store.LabelKindProject, adminv1.LabelScopeKind_LABEL_SCOPE_KIND_PROJECT},
	{store.LabelKindTag, adminv1.LabelScopeKind_LABEL_SCOPE_KIND_TAG},
}

func labelScopeToProto(l store.LabelScope) (*adminv1.LabelScope, error) {
	lim, err := limitsFromJSON(l.Limits)
	if err != nil {
		return nil, err
	}
	return &adminv1.LabelScope{
		Id: l.ID, OrgId: l.OrgID, Kind: labelKinds.toProto(l.Kind), Name: l.Name, Limits: lim,
		CreateTime: timestamppb.New(l.CreatedAt), UpdateTime: timestamppb.New(l.UpdatedAt),
	}, nil
}

// validateLabelScope checks ls. The name must be one a key can carry: a
// project is what keys accept as a project (1–100 characters, no
// surrounding spaces or control characters), a tag what they accept as a
// tag. Fields are named as in create requests and update masks.
func validateLabelScope(ls *adminv1.LabelScope) error {
	c := &validator{}
	lvl := LevelProject
	switch ls.GetKind() {
	case adminv1.LabelScopeKind_LABEL_SCOPE_KIND_PROJECT:
		if ls.GetName() == "" {
			c.add("name", "required")
		} else {
			validateProject(c, "name", ls.GetName())
		}
	case adminv1.LabelScopeKind_LABEL_SCOPE_KIND_TAG:
		lvl = LevelTag
		validateTag(c, "name", ls.GetName())
	default:
		c.add("kind", "must be LABEL_SCOPE_KIND_PROJECT or LABEL_SCOPE_KIND_TAG")
	}
	validateLimits(c, "limits", ls.GetLimits(), lvl, nil)
	return c.err()
}

// validateProject checks a non-empty project name, as a key carries it
// and a project scope names it: 1–100 characters of valid UTF-8, no
// surrounding spaces, no control characters.
func validateProject(c *validator, field, name string) {
	switch {
	case !utf8.ValidString(name) || utf8.RuneCountInString(name) > maxKeyLabelLen:
		c.add(field, "must be 1–%d characters of valid UTF-8", maxKeyLabelLen)
	default:
		validateBareText(c, field, name)
	}
}

// validateTag checks a tag, as a key carries it and a tag scope names it.
func validateTag(c *validator, field, tag string) {
	if !tagPattern.MatchString(tag) {
		c.add(field, "tag %q must be 1–%d characters of A-Z a-z 0-9 _ . : / -", tag, maxKeyTagLen)
	}
}

func (s *labelScopeService) CreateLabelScope(ctx context.Context, req *connect.Request[adminv1.CreateLabelScopeRequest]) (*connect.Response[adminv1.CreateLabelScopeResponse], error) {
	m := req.Msg
	orgID, err := createTenant(ctx, m.GetOrgId(), labelScopesWhat)
	if err != nil {
		return nil, err
	}
	want := &adminv1.LabelScope{Kind: m.GetKind(), Name: m.GetName(), Limits: m.GetLimits()}
	if err := validateLabelScope(want); err != nil {
		return nil, err
	}
	kind, _ := labelKinds.fromProto(want.Kind) // validated
	ls := store.LabelScope{ID: ids.New(ids.LabelScope), OrgID: orgID, Kind: kind, Name: want.Name,
		Limits: limitsJSON(want.Limits)}
	out, err := createObject(ctx, s.store, labelScopeObjects, &ls, func(tx *store.Tx) error { return tx.LabelScopeInsert(ctx, &ls) })
	return reply(&adminv1.CreateLabelScopeResponse{LabelScope: out}, err)
}

func (s *labelScopeService) GetLabelScope(ctx context.Context, req *connect.Request[adminv1.GetLabelScopeRequest]) (*connect.Response[adminv1.GetLabelScopeResponse], error) {
	id := req.Msg.GetId()
	if err := orgObjectGate(ctx, authz.Read, labelScopesWhat, "id", id); err != nil {
		return nil, err
	}
	out, err := getObject(ctx, s.store, labelScopeObjects, id)
	return reply(&adminv1.GetLabelScopeResponse{LabelScope: out}, err)
}

func (s *labelScopeService) ListLabelScopes(ctx context.Context, req *connect.Request[adminv1.ListLabelScopesRequest]) (*connect.Response[adminv1.ListLabelScopesResponse], error) {
	m := req.Msg
	if err := orgLevelGate(ctx, authz.Read, labelScopesWhat); err != nil {
		return nil, err
	}
	t, err := listTenant(ctx, m.GetOrgId(), labelScopesWhat)
	if err != nil {
		return nil, err
	}
	q := store.LabelScopeQuery{NamePrefix: m.GetNamePrefix()}
	if k := m.GetKind(); k != adminv1.LabelScopeKind_LABEL_SCOPE_KIND_UNSPECIFIED {
		var ok bool
		if q.Kind, ok = labelKinds.fromProto(k); !ok {
			return nil, invalid("kind", "must be LABEL_SCOPE_KIND_PROJECT, LABEL_SCOPE_KIND_TAG or unset")
		}
	}
	limit, after, err := pageArgs(m.GetPageSize(), m.GetPageToken())
	if err != nil {
		return nil, err
	}
	rows, err := s.store.LabelScopeList(ctx, t, q, store.Page{After: after, Limit: limit})
	if err != nil {
		return nil, err
	}
	resp := &adminv1.ListLabelScopesResponse{}
	resp.LabelScopes, resp.NextPageToken, err = page(rows, limit, labelScopeToProto, func(l store.LabelScope) string { return l.ID })
	return reply(resp, err)
}

func (s *labelScopeService) UpdateLabelScope(ctx context.Context, req *connect.Request[adminv1.UpdateLabelScopeRequest]) (*connect.Response[adminv1.UpdateLabelScopeResponse], error) {
	src, mask := req.Msg.GetLabelScope(), req.Msg.GetUpdateMask()
	if err := labelScopeObjects.gate(ctx, "label_scope.id", src.GetId()); err != nil {
		return nil, err
	}
	if err := refuseImmutable(mask, "keys name the scope by it; create a new scope instead", "kind", "name"); err != nil {
		return nil, err
	}
	out, err := updateObject(ctx, s.store, labelScopeObjects, src.GetId(), src, mask, labelScopeUpdatable,
		func(tx *store.Tx, cur *store.LabelScope, _, after *adminv1.LabelScope) error {
			if err := validateLabelScope(after); err != nil {
				return err
			}
			cur.Limits = limitsJSON(after.Limits)
			return tx.LabelScopeUpdate(ctx, cur)
		})
	return reply(&adminv1.UpdateLabelScopeResponse{LabelScope: out}, err)
}

func (s *labelScopeService) DeleteLabelScope(ctx context.Context, req *connect.Request[adminv1.DeleteLabelScopeRequest]) (*connect.Response[adminv1.DeleteLabelScopeResponse], error) {
	return reply(&adminv1.DeleteLabelScopeResponse{}, deleteObject(ctx, s.store, labelScopeObjects, req.Msg.GetId()))
}

// labelScopesWhat names label scopes in authorisation errors.
const labelScopesWhat = "project and tag scopes"

// labelScopeObjects is the object of Create/Update/DeleteLabelScope (label
// scopes are not blockable: block the keys or their team instead).
var labelScopeObjects = mutable[store.LabelScope, *adminv1.LabelScope]{
	object: events.ObjLabelScope,
	gate: func(ctx context.Context, field, id string) error {
		return orgObjectGate(ctx, authz.Write, labelScopesWhat, field, id)
	},
	get:          (*store.Store).LabelScopeGet,
	getForUpdate: (*store.Tx).LabelScopeGetForUpdate,
	target:       func(v store.LabelScope) authz.Target { return authz.OrgTarget(v.OrgID, "label scope "+v.ID) },
	remove: func(ctx context.Context, tx *store.Tx, cur store.LabelScope) (any, error) {
		return nil, tx.LabelScopeDelete(ctx, cur.ID)
	},
	toProto: labelScopeToProto,
	scope:   func(l store.LabelScope) (string, string, string) { return l.ID, l.OrgID, "" },
}
