package admin

import (
	"context"
	"fmt"
	"strings"

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

// teamService implements TeamService.
//
// Authorisation: creating, updating, blocking and deleting a team targets
// the team's org (authz.OrgTarget), so only org- and platform-scoped
// editors may do it; reading a team and managing its members target the
// team itself (authz.TeamTarget), so a team-scoped token reaches its own
// team and nothing else. Reads are filtered by the caller's tenant first:
// teams the caller may not see are NotFound.
type teamService struct{ *Server }

const (
	objTeam       = string(events.ObjTeam)
	objTeamMember = string(events.ObjMember)
)

// trafficClassPrefix is the enum value prefix dropped in the stored form.
const trafficClassPrefix = "TRAFFIC_CLASS_"

// trafficClassToDB returns the stored form of tc: "" for unspecified,
// otherwise the lower-case enum name without its prefix ("interactive",
// "agent", "batch"), so the column stays readable and independent of enum
// numbers.
func trafficClassToDB(tc adminv1.TrafficClass) string {
	if tc == adminv1.TrafficClass_TRAFFIC_CLASS_UNSPECIFIED {
		return ""
	}
	return strings.ToLower(strings.TrimPrefix(tc.String(), trafficClassPrefix))
}

// trafficClassFromDB parses the stored form written by trafficClassToDB.
func trafficClassFromDB(s string) (adminv1.TrafficClass, error) {
	if s == "" {
		return adminv1.TrafficClass_TRAFFIC_CLASS_UNSPECIFIED, nil
	}
	v, ok := adminv1.TrafficClass_value[trafficClassPrefix+strings.ToUpper(s)]
	if !ok {
		return 0, fmt.Errorf("decode stored traffic class %q: unknown", s)
	}
	return adminv1.TrafficClass(v), nil
}

func teamToProto(t store.Team) (*adminv1.Team, error) {
	l, err := limitsFromJSON(t.Limits)
	if err != nil {
		return nil, err
	}
	tc, err := trafficClassFromDB(t.TrafficClass)
	if err != nil {
		return nil, err
	}
	return &adminv1.Team{
		Id: t.ID, OrgId: t.OrgID, Name: t.Name, Limits: l, Blocked: t.Blocked, Metadata: t.Metadata,
		TrafficClass: tc, ModelGroupAliases: t.ModelGroupAliases, Fallbacks: fallbacksToProto(t.Fallbacks),
		CreateTime: timestamppb.New(t.CreatedAt), UpdateTime: timestamppb.New(t.UpdatedAt),
	}, nil
}

func validateTeam(t *adminv1.Team) error {
	c := &validator{}
	checkTeam(c, t)
	return c.err()
}

// checkTeam adds the violations of t's settable fields to c.
func checkTeam(c *validator, t *adminv1.Team) {
	validateName(c, "name", t.GetName(), 100)
	validateLimits(c, "limits", t.GetLimits(), LevelTeam, nil)
	validateMetadata(c, t.GetMetadata())
	validateTrafficClass(c, "traffic_class", t.GetTrafficClass())
	validateAliases(c, "model_group_aliases", t.GetModelGroupAliases())
	validateFallbackOverrides(c, "fallbacks", t.GetFallbacks())
}

func requireField(field, v string) error {
	if v == "" {
		return invalid(field, "required")
	}
	return nil
}

func (s *teamService) CreateTeam(ctx context.Context, req *connect.Request[adminv1.CreateTeamRequest]) (*connect.Response[adminv1.CreateTeamResponse], error) {
	p := principal(ctx)
	m := req.Msg
	orgID := m.GetOrgId()
	if orgID == "" {
		orgID = p.OrgID // default to the caller's org
	}
	if err := authz.Check(ctx, p, authz.Write, authz.OrgTarget(orgID, "teams of org "+orgID)); err != nil {
		return nil, err
	}
	want := &adminv1.Team{
		OrgId: orgID, Name: m.GetName(), Limits: m.GetLimits(), Metadata: m.GetMetadata(),
		TrafficClass: m.GetTrafficClass(), ModelGroupAliases: m.GetModelGroupAliases(), Fallbacks: m.GetFallbacks(),
	}
	c := &validator{}
	if orgID == "" {
		c.add("org_id", "required with a platform-scoped token")
	}
	checkTeam(c, want)
	if err := c.err(); err != nil {
		return nil, err
	}
	t := store.Team{
		ID: ids.New(ids.Team), OrgID: orgID, Name: want.Name, Limits: limitsJSON(want.Limits), Metadata: want.Metadata,
		TrafficClass: trafficClassToDB(want.TrafficClass), ModelGroupAliases: want.ModelGroupAliases,
	}
	out, err := createObject(ctx, s.store, teamObjects, &t, func(tx *store.Tx) error {
		// The org must exist and be visible; locking it keeps it from
		// being deleted under the new team.
		if _, err := tx.OrgGetForUpdate(ctx, tenant(ctx), orgID); err != nil {
			return err
		}
		if err := tx.TeamInsert(ctx, &t); err != nil {
			return err
		}
		return setOverrides(ctx, tx, nil, want.GetFallbacks(), func(f store.Fallbacks) error { return tx.TeamFallbacksSet(ctx, &t, f) })
	})
	return reply(&adminv1.CreateTeamResponse{Team: out}, err)
}

func (s *teamService) GetTeam(ctx context.Context, req *connect.Request[adminv1.GetTeamRequest]) (*connect.Response[adminv1.GetTeamResponse], error) {
	if err := requireField("id", req.Msg.GetId()); err != nil {
		return nil, err
	}
	t, err := s.store.TeamGet(ctx, tenant(ctx), req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	if err := authz.Check(ctx, principal(ctx), authz.Read, authz.TeamTarget(t.OrgID, t.ID, "team "+t.ID)); err != nil {
		return nil, err
	}
	out, err := teamToProto(t)
	return reply(&adminv1.GetTeamResponse{Team: out}, err)
}

func (s *teamService) ListTeams(ctx context.Context, req *connect.Request[adminv1.ListTeamsRequest]) (*connect.Response[adminv1.ListTeamsResponse], error) {
	p := principal(ctx)
	t := tenant(ctx)
	if o := req.Msg.GetOrgId(); o != "" {
		if t.OrgID != "" && t.OrgID != o {
			// Naming another org is refused outright (not an empty list).
			return nil, authz.Check(ctx, p, authz.Read, authz.OrgTarget(o, "teams of org "+o))
		}
		t.OrgID = o
	}
	target := authz.PlatformTarget("listing teams")
	switch {
	case p.Scope == authz.ScopeTeam:
		target = authz.TeamTarget(p.OrgID, p.TeamID, "team "+p.TeamID)
	case t.OrgID != "":
		target = authz.OrgTarget(t.OrgID, "teams of org "+t.OrgID)
	}
	if err := authz.Check(ctx, p, authz.Read, target); err != nil {
		return nil, err
	}
	limit, after, err := pageArgs(req.Msg.GetPageSize(), req.Msg.GetPageToken())
	if err != nil {
		return nil, err
	}
	rows, err := s.store.TeamList(ctx, t, store.TeamQuery{NamePrefix: req.Msg.GetNamePrefix(), Blocked: req.Msg.Blocked},
		store.Page{After: after, Limit: limit})
	if err != nil {
		return nil, err
	}
	resp := &adminv1.ListTeamsResponse{}
	resp.Teams, resp.NextPageToken, err = page(rows, limit, teamToProto, func(t store.Team) string { return t.ID })
	return reply(resp, err)
}

func (s *teamService) UpdateTeam(ctx context.Context, req *connect.Request[adminv1.UpdateTeamRequest]) (*connect.Response[adminv1.UpdateTeamResponse], error) {
	src := req.Msg.GetTeam()
	if err := teamObjects.gate(ctx, "team.id", src.GetId()); err != nil {
		return nil, err
	}
	out, err := updateObject(ctx, s.store, teamObjects, src.GetId(), src, req.Msg.GetUpdateMask(),
		[]string{"name", "limits", "metadata", "traffic_class", "model_group_aliases", "fallbacks"},
		func(tx *store.Tx, cur *store.Team, before, after *adminv1.Team) error {
			if err := validateTeam(after); err != nil {
				return err
			}
			cur.Name, cur.Limits, cur.Metadata = after.Name, limitsJSON(after.Limits), after.Metadata
			cur.TrafficClass, cur.ModelGroupAliases = trafficClassToDB(after.TrafficClass), after.ModelGroupAliases
			if err := tx.TeamUpdate(ctx, cur); err != nil {
				return err
			}
			return setOverrides(ctx, tx, before.GetFallbacks(), after.GetFallbacks(), func(f store.Fallbacks) error { return tx.TeamFallbacksSet(ctx, cur, f) })
		})
	return reply(&adminv1.UpdateTeamResponse{Team: out}, err)
}

func (s *teamService) DeleteTeam(ctx context.Context, req *connect.Request[adminv1.DeleteTeamRequest]) (*connect.Response[adminv1.DeleteTeamResponse], error) {
	return reply(&adminv1.DeleteTeamResponse{}, deleteObject(ctx, s.store, teamObjects, req.Msg.GetId()))
}

// teamObjects is the object of Create/Update/Block/Unblock/DeleteTeam; its
// audit record names the team as its own team, so that the team's own
// tokens can read its trail.
var teamObjects = mutable[store.Team, *adminv1.Team]{
	object: events.ObjTeam,
	gate:   func(_ context.Context, field, id string) error { return requireField(field, id) },
	// Changes target the team's org; reads (GetTeam) the team itself.
	getForUpdate: (*store.Tx).TeamGetForUpdate,
	target:       func(t store.Team) authz.Target { return authz.OrgTarget(t.OrgID, "team "+t.ID) },
	set: func(ctx context.Context, tx *store.Tx, cur *store.Team, b bool) error {
		return tx.TeamSetBlocked(ctx, cur, b)
	},
	// Memberships cascade; data planes drop them with the team on
	// team.deleted, so no member.deleted events are written.
	remove: func(ctx context.Context, tx *store.Tx, cur store.Team) (any, error) {
		return nil, tx.TeamDelete(ctx, cur.OrgID, cur.ID)
	},
	toProto: teamToProto,
	scope:   func(t store.Team) (string, string, string) { return t.ID, t.OrgID, t.ID },
}

func (s *teamService) BlockTeam(ctx context.Context, req *connect.Request[adminv1.BlockTeamRequest]) (*connect.Response[adminv1.BlockTeamResponse], error) {
	t, err := setBlocked(ctx, s.store, teamObjects, req.Msg.GetId(), true)
	return reply(&adminv1.BlockTeamResponse{Team: t}, err)
}

func (s *teamService) UnblockTeam(ctx context.Context, req *connect.Request[adminv1.UnblockTeamRequest]) (*connect.Response[adminv1.UnblockTeamResponse], error) {
	t, err := setBlocked(ctx, s.store, teamObjects, req.Msg.GetId(), false)
	return reply(&adminv1.UnblockTeamResponse{Team: t}, err)
}

// Team members.

func memberToProto(m store.TeamMember) (*adminv1.TeamMember, error) {
	l, err := limitsFromJSON(m.Limits)
	if err != nil {
		return nil, err
	}
	out := &adminv1.TeamMember{
		TeamId: m.TeamID, UserId: m.UserID, OrgId: m.OrgID, Limits: l,
		CreateTime: timestamppb.New(m.CreatedAt), UpdateTime: timestamppb.New(m.UpdatedAt),
	}
	if m.MaxBudgetInTeam != nil {
		out.MaxBudgetInTeam = proto.Float64(*m.MaxBudgetInTeam)
	}
	return out, nil
}

// validateMember checks the settable fields of a membership: member-level
// limits and max_budget_in_team (which takes the place of max_budget).
func validateMember(m *adminv1.TeamMember) error {
	c := &validator{}
	validateLimits(c, "limits", m.GetLimits(), LevelMember, m.MaxBudgetInTeam)
	return c.err()
}

// memberObjectID is the audit and outbox object id of a membership.
func memberObjectID(teamID, userID string) string { return events.MemberObjectID(teamID, userID) }

func memberAudit(ctx context.Context, tx *store.Tx, action string, m store.TeamMember, before, after *adminv1.TeamMember) error {
	var b, a []byte
	if before != nil {
		b = auditJSON(before)
	}
	if after != nil {
		a = auditJSON(after)
	}
	return tx.Audit(ctx, action, objTeamMember, memberObjectID(m.TeamID, m.UserID), m.OrgID, m.TeamID, b, a)
}

// requireMember checks that the two ids naming a membership are given,
// reporting both (fields prefix+"team_id" and prefix+"user_id").
func requireMember(prefix, teamID, userID string) error {
	c := &validator{}
	if teamID == "" {
		c.add(prefix+"team_id", "required")
	}
	if userID == "" {
		c.add(prefix+"user_id", "required")
	}
	return c.err()
}

// memberTeam returns the team teamID locked for the rest of tx, after
// checking that the caller may apply verb to its members.
func memberTeam(ctx context.Context, tx *store.Tx, verb authz.Verb, teamID string) (store.Team, error) {
	t, err := tx.TeamGetForUpdate(ctx, tenant(ctx), teamID)
	if err != nil {
		return store.Team{}, err
	}
	if err := authz.Check(ctx, principal(ctx), verb, authz.TeamTarget(t.OrgID, t.ID, "members of team "+t.ID)); err != nil {
		return store.Team{}, err
	}
	return t, nil
}

func (s *teamService) AddTeamMember(ctx context.Context, req *connect.Request[adminv1.AddTeamMemberRequest]) (*connect.Response[adminv1.AddTeamMemberResponse], error) {
	m := req.Msg
	if err := requireMember("", m.GetTeamId(), m.GetUserId()); err != nil {
		return nil, err
	}
	var out *adminv1.TeamMember
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		t, err := memberTeam(ctx, tx, authz.Write, m.GetTeamId())
		if err != nil {
			return err
		}
		want := &adminv1.TeamMember{MaxBudgetInTeam: m.MaxBudgetInTeam, Limits: m.GetLimits()}
		if err := validateMember(want); err != nil {
			return err
		}
		mem := store.TeamMember{
			TeamID: t.ID, UserID: m.GetUserId(), OrgID: t.OrgID, MaxBudgetInTeam: m.MaxBudgetInTeam, Limits: limitsJSON(want.Limits),
		}
		if err := tx.TeamMemberInsert(ctx, &mem); err != nil {
			return err
		}
		if out, err = memberToProto(mem); err != nil {
			return err
		}
		if err := memberAudit(ctx, tx, audit.ActionMemberAdded, mem, nil, out); err != nil {
			return err
		}
		return memberOutbox(ctx, tx, events.MemberUpserted, mem)
	})
	return reply(&adminv1.AddTeamMemberResponse{Member: out}, err)
}

func (s *teamService) UpdateTeamMember(ctx context.Context, req *connect.Request[adminv1.UpdateTeamMemberRequest]) (*connect.Response[adminv1.UpdateTeamMemberResponse], error) {
	src := req.Msg.GetMember()
	if err := requireMember("member.", src.GetTeamId(), src.GetUserId()); err != nil {
		return nil, err
	}
	var out *adminv1.TeamMember
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		t, err := memberTeam(ctx, tx, authz.Write, src.GetTeamId())
		if err != nil {
			return err
		}
		cur, err := tx.TeamMemberGetForUpdate(ctx, t.OrgID, t.ID, src.GetUserId())
		if err != nil {
			return err
		}
		before, err := memberToProto(cur)
		if err != nil {
			return err
		}
		after := proto.Clone(before).(*adminv1.TeamMember)
		if err := applyMask(after, src, req.Msg.GetUpdateMask(), "max_budget_in_team", "limits"); err != nil {
			return err
		}
		if err := validateMember(after); err != nil {
			return err
		}
		cur.MaxBudgetInTeam, cur.Limits = after.MaxBudgetInTeam, limitsJSON(after.Limits)
		if err := tx.TeamMemberUpdate(ctx, &cur); err != nil {
			return err
		}
		after.UpdateTime = timestamppb.New(cur.UpdatedAt)
		out = after
		if err := memberAudit(ctx, tx, audit.ActionMemberUpdated, cur, before, after); err != nil {
			return err
		}
		return memberOutbox(ctx, tx, events.MemberUpserted, cur)
	})
	return reply(&adminv1.UpdateTeamMemberResponse{Member: out}, err)
}

func (s *teamService) RemoveTeamMember(ctx context.Context, req *connect.Request[adminv1.RemoveTeamMemberRequest]) (*connect.Response[adminv1.RemoveTeamMemberResponse], error) {
	m := req.Msg
	if err := requireMember("", m.GetTeamId(), m.GetUserId()); err != nil {
		return nil, err
	}
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		t, err := memberTeam(ctx, tx, authz.Write, m.GetTeamId())
		if err != nil {
			return err
		}
		cur, err := tx.TeamMemberGetForUpdate(ctx, t.OrgID, t.ID, m.GetUserId())
		if err != nil {
			return err
		}
		before, err := memberToProto(cur)
		if err != nil {
			return err
		}
		if err := tx.TeamMemberDelete(ctx, cur); err != nil {
			return err
		}
		if err := memberAudit(ctx, tx, audit.ActionMemberRemoved, cur, before, nil); err != nil {
			return err
		}
		return memberOutbox(ctx, tx, events.MemberDeleted, cur)
	})
	return reply(&adminv1.RemoveTeamMemberResponse{}, err)
}

func (s *teamService) ListTeamMembers(ctx context.Context, req *connect.Request[adminv1.ListTeamMembersRequest]) (*connect.Response[adminv1.ListTeamMembersResponse], error) {
	if err := requireField("team_id", req.Msg.GetTeamId()); err != nil {
		return nil, err
	}
	t, err := s.store.TeamGet(ctx, tenant(ctx), req.Msg.GetTeamId())
	if err != nil {
		return nil, err
	}
	if err := authz.Check(ctx, principal(ctx), authz.Read, authz.TeamTarget(t.OrgID, t.ID, "members of team "+t.ID)); err != nil {
		return nil, err
	}
	limit, after, err := pageArgs(req.Msg.GetPageSize(), req.Msg.GetPageToken())
	if err != nil {
		return nil, err
	}
	rows, err := s.store.TeamMemberList(ctx, t.OrgID, t.ID, store.Page{After: after, Limit: limit})
	if err != nil {
		return nil, err
	}
	resp := &adminv1.ListTeamMembersResponse{}
	resp.Members, resp.NextPageToken, err = page(rows, limit, memberToProto, func(m store.TeamMember) string { return m.UserID })
	return reply(resp, err)
}
