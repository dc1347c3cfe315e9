package admin

import "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"

// teamService implements TeamService.
type teamService struct {
	*Server
	adminv1connect.UnimplementedTeamServiceHandler
}
