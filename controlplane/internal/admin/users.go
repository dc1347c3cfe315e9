package admin

import (
	"context"
	"strings"
	"unicode"
	"unicode/utf8"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/events"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/ids"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// userService implements UserService.
type userService struct{ *Server }

const (
	maxEmailLen       = 254 // RFC 5321 path limit
	maxDisplayNameLen = 200
)

// userUpdatable lists the update_mask paths UpdateUser accepts (nested
// "limits.<field>" paths included through "limits").
var userUpdatable = []string{"email", "display_name", "limits", "metadata"}

// orgLevelGate refuses, before anything is read, callers that may never
// apply verb to an org-level object (users, customers): team-scoped
// tokens, and viewers asking to change something. Refusing up front means
// such a caller cannot learn whether an id exists. The check against the
// object's own org follows once it is loaded.
func orgLevelGate(ctx context.Context, verb authz.Verb, what string) error {
	p := principal(ctx)
	return authz.Check(ctx, p, verb, authz.OrgTarget(p.OrgID, what))
}

// createOrg resolves the org_id of a create request: required for
// platform-scoped tokens, the caller's org otherwise.
func createOrg(ctx context.Context, orgID string) (string, error) {
	if orgID != "" {
		return orgID, nil
	}
	p := principal(ctx)
	if p.Scope == authz.ScopePlatform {
		return "", invalid("org_id", "required with a platform-scoped token")
	}
	return p.OrgID, nil
}

// listTenant resolves the org filter of a list request against the
// caller's scope and authorises the read. A filter naming another org than
// the caller's is refused.
func listTenant(ctx context.Context, orgFilter, what string) (store.Tenant, error) {
	p := principal(ctx)
	t := tenant(ctx)
	orgID := orgFilter
	if orgID == "" {
		orgID = t.OrgID // "" for platform tokens: every org
	}
	target := authz.OrgTarget(orgID, what+" of org "+orgID)
	if orgID == "" {
		target = authz.OrgTarget("", what+" of every org")
	}
	if err := authz.Check(ctx, p, authz.Read, target); err != nil {
		return store.Tenant{}, err
	}
	return store.Tenant{OrgID: orgID}, nil
}

func requireID(field, id string) error {
	if id == "" {
		return invalid(field, "required")
	}
	return nil
}

func userToProto(u store.User) (*adminv1.User, error) {
	l, err := limitsFromJSON(u.Limits)
	if err != nil {
		return nil, err
	}
	return &adminv1.User{
		Id: u.ID, OrgId: u.OrgID, Email: u.Email, DisplayName: u.DisplayName, Limits: l, Blocked: u.Blocked,
		Metadata: u.Metadata, CreateTime: timestamppb.New(u.CreatedAt), UpdateTime: timestamppb.New(u.UpdatedAt),
	}, nil
}

// normalizeEmail lower-cases an email for storage and comparison.
func normalizeEmail(e string) string { return strings.ToLower(e) }

// validateEmail checks a (lower-cased) email address: a non-empty local
// part, "@", a non-empty domain, no spaces or control characters, at most
// maxEmailLen characters. Deliverability is not checked.
func validateEmail(c *validator, field, e string) {
	switch at := strings.LastIndexByte(e, '@'); {
	case e == "":
		c.add(field, "required")
	case !utf8.ValidString(e) || utf8.RuneCountInString(e) > maxEmailLen:
		c.add(field, "must be at most %d characters", maxEmailLen)
	case strings.IndexFunc(e, func(r rune) bool { return unicode.IsSpace(r) || unicode.IsControl(r) }) >= 0:
		c.add(field, "must not contain spaces or control characters")
	case strings.IndexByte(e, '@') < 1 || at == len(e)-1:
		c.add(field, "%q is not an email address: want local-part@domain", e)
	}
}

// validateDisplayName checks an optional display name.
func validateDisplayName(c *validator, field, s string) {
	if !utf8.ValidString(s) || utf8.RuneCountInString(s) > maxDisplayNameLen {
		c.add(field, "must be at most %d characters", maxDisplayNameLen)
	}
}

// validateUser checks u (email already lower-cased). Fields are named as
// in create requests and update masks ("email", "limits.rpm_limit").
func validateUser(u *adminv1.User) error {
	c := &validator{}
	validateEmail(c, "email", u.GetEmail())
	validateDisplayName(c, "display_name", u.GetDisplayName())
	validateLimits(c, "limits", u.GetLimits(), LevelUser, nil)
	validateMetadata(c, u.GetMetadata())
	return c.err()
}

func (s *userService) CreateUser(ctx context.Context, req *connect.Request[adminv1.CreateUserRequest]) (*connect.Response[adminv1.CreateUserResponse], error) {
	m := req.Msg
	orgID, err := createTenant(ctx, m.GetOrgId(), "users")
	if err != nil {
		return nil, err
	}
	want := &adminv1.User{Email: normalizeEmail(m.GetEmail()), DisplayName: m.GetDisplayName(), Limits: m.GetLimits(), Metadata: m.GetMetadata()}
	if err := validateUser(want); err != nil {
		return nil, err
	}
	u := store.User{ID: ids.New(ids.User), OrgID: orgID, Email: want.Email, DisplayName: want.DisplayName,
		Limits: limitsJSON(want.Limits), Metadata: want.Metadata}
	out, err := createObject(ctx, s.store, userObjects, &u, func(tx *store.Tx) error { return tx.UserInsert(ctx, &u) })
	return reply(&adminv1.CreateUserResponse{User: out}, err)
}

func (s *userService) GetUser(ctx context.Context, req *connect.Request[adminv1.GetUserRequest]) (*connect.Response[adminv1.GetUserResponse], error) {
	id := req.Msg.GetId()
	if err := orgObjectGate(ctx, authz.Read, "users", "id", id); err != nil {
		return nil, err
	}
	out, err := getObject(ctx, s.store, userObjects, id)
	return reply(&adminv1.GetUserResponse{User: out}, err)
}

func (s *userService) ListUsers(ctx context.Context, req *connect.Request[adminv1.ListUsersRequest]) (*connect.Response[adminv1.ListUsersResponse], error) {
	m := req.Msg
	t, err := listTenant(ctx, m.GetOrgId(), "users")
	if err != nil {
		return nil, err
	}
	limit, after, err := pageArgs(m.GetPageSize(), m.GetPageToken())
	if err != nil {
		return nil, err
	}
	q := store.UserQuery{EmailPrefix: normalizeEmail(m.GetEmailPrefix()), Blocked: m.Blocked}
	rows, err := s.store.UserList(ctx, t, q, store.Page{After: after, Limit: limit})
	if err != nil {
		return nil, err
	}
	resp := &adminv1.ListUsersResponse{}
	resp.Users, resp.NextPageToken, err = page(rows, limit, userToProto, func(u store.User) string { return u.ID })
	return reply(resp, err)
}

func (s *userService) UpdateUser(ctx context.Context, req *connect.Request[adminv1.UpdateUserRequest]) (*connect.Response[adminv1.UpdateUserResponse], error) {
	src := req.Msg.GetUser()
	if err := userObjects.gate(ctx, "user.id", src.GetId()); err != nil {
		return nil, err
	}
	out, err := updateObject(ctx, s.store, userObjects, src.GetId(), src, req.Msg.GetUpdateMask(), userUpdatable,
		func(tx *store.Tx, cur *store.User, _, after *adminv1.User) error {
			after.Email = normalizeEmail(after.Email)
			if err := validateUser(after); err != nil {
				return err
			}
			cur.Email, cur.DisplayName, cur.Limits, cur.Metadata = after.Email, after.DisplayName, limitsJSON(after.Limits), after.Metadata
			return tx.UserUpdate(ctx, cur)
		})
	return reply(&adminv1.UpdateUserResponse{User: out}, err)
}

func (s *userService) DeleteUser(ctx context.Context, req *connect.Request[adminv1.DeleteUserRequest]) (*connect.Response[adminv1.DeleteUserResponse], error) {
	return reply(&adminv1.DeleteUserResponse{}, deleteObject(ctx, s.store, userObjects, req.Msg.GetId()))
}

// userObjects is the object of Create/Update/Block/Unblock/DeleteUser.
var userObjects = mutable[store.User, *adminv1.User]{
	object: events.ObjUser,
	gate: func(ctx context.Context, field, id string) error {
		return orgObjectGate(ctx, authz.Write, "users", field, id)
	},
	get:          (*store.Store).UserGet,
	getForUpdate: (*store.Tx).UserGetForUpdate,
	target:       func(v store.User) authz.Target { return authz.OrgTarget(v.OrgID, "user "+v.ID) },
	set: func(ctx context.Context, tx *store.Tx, cur *store.User, b bool) error {
		return tx.UserSetBlocked(ctx, cur, b)
	},
	// The user's memberships go with it; the payload names their teams.
	remove: func(ctx context.Context, tx *store.Tx, cur store.User) (any, error) {
		teamIDs, err := tx.UserDelete(ctx, cur)
		return events.UserDeletedPayload{TeamIDs: teamIDs}, err
	},
	toProto: userToProto,
	scope:   func(u store.User) (string, string, string) { return u.ID, u.OrgID, "" },
}

func (s *userService) BlockUser(ctx context.Context, req *connect.Request[adminv1.BlockUserRequest]) (*connect.Response[adminv1.BlockUserResponse], error) {
	u, err := setBlocked(ctx, s.store, userObjects, req.Msg.GetId(), true)
	return reply(&adminv1.BlockUserResponse{User: u}, err)
}

func (s *userService) UnblockUser(ctx context.Context, req *connect.Request[adminv1.UnblockUserRequest]) (*connect.Response[adminv1.UnblockUserResponse], error) {
	u, err := setBlocked(ctx, s.store, userObjects, req.Msg.GetId(), false)
	return reply(&adminv1.UnblockUserResponse{User: u}, err)
}
